//! A private nginx for tests: started on a free loopback port with a
//! configuration the test writes, no daemon, no master process, stopped on
//! drop. Without nginx on PATH (Debian: `apt-get install nginx-light`) the
//! test is skipped loudly, except under `CI=true`, where it fails.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running nginx.
pub struct Nginx {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
    dir: PathBuf,
}

fn binary() -> Option<PathBuf> {
    ["nginx", "/usr/sbin/nginx"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| Command::new(p).arg("-v").output().is_ok())
}

impl Nginx {
    /// Starts nginx with `server` as the body of its one `server` block
    /// (the `listen` line is added), or returns `None` when nginx is not
    /// installed and `CI` is not `true`.
    pub fn start(server: &str) -> Option<Self> {
        let Some(nginx) = binary() else {
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("nginx is not installed, and CI=true requires the nginx tests to run");
            }
            eprintln!("\n*** SKIPPED: nginx is not installed (apt-get install nginx-light) ***\n");
            return None;
        };
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let dir =
            std::env::temp_dir().join(format!("tollgate-nginx-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("nginx directory");
        let d = dir.display();
        let config = format!(
            "error_log {d}/error.log error;\n\
             pid {d}/nginx.pid;\n\
             events {{ worker_connections 512; }}\n\
             http {{\n\
               access_log off;\n\
               client_body_temp_path {d}/body;\n\
               proxy_temp_path {d}/proxy;\n\
               fastcgi_temp_path {d}/fastcgi;\n\
               uwsgi_temp_path {d}/uwsgi;\n\
               scgi_temp_path {d}/scgi;\n\
               large_client_header_buffers 8 64k;\n\
               server {{\n\
                 listen {addr};\n\
                 {server}\n\
               }}\n\
             }}\n"
        );
        let conf = dir.join("nginx.conf");
        std::fs::write(&conf, config).expect("writing nginx.conf");
        let child = Command::new(nginx)
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(&conf)
            .args(["-g", "daemon off; master_process off;"])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting nginx");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "nginx did not listen within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(Self { child, addr, dir })
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
