//! `rediss://` against a real redis-server with a TLS port and certificates
//! the test makes: a private CA trusted, the `#insecure` form, a wrong CA
//! and an expired certificate refused as *unavailable* with nothing spent.
#![cfg(feature = "tls")]

use std::time::Duration;

use tollgate_budget::{Charge, Key, Policy, Rate, Store, StoreErrorKind};
use tollgate_redis::RedisStore;
use tollgate_testkit::{RedisServer, TestCertificates, free_loopback_port};

fn charge(key: &str) -> Charge {
    let p = Policy::token_bucket("tls", 2, Rate::per_hour(1)).unwrap();
    Charge::new(Key::new("tls").with(key), p, 1).unwrap()
}

/// A server with a TLS port serving `cert`; its plain port stays open for
/// the test's own inspection.
fn tls_server(certs: &TestCertificates, cert: &str) -> Option<(RedisServer, String)> {
    let tls_port = free_loopback_port();
    let args = certs.server_args(tls_port, cert);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = RedisServer::start_with(&args)?;
    Some((server, format!("rediss://127.0.0.1:{tls_port}")))
}

/// The whole chain of an error, for messages that must say what was wrong.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_redis_with_a_private_ca() {
    let certs = tollgate_testkit::or_skip!(TestCertificates::generate());
    let (server, url) = tollgate_testkit::or_skip!(tls_server(&certs, "server.pem"));
    let store = RedisStore::builder(&url)
        .unwrap()
        .tls_root_certificate(certs.read("ca.pem"))
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let c = charge("trusted");
    assert!(
        store
            .charge(std::slice::from_ref(&c))
            .await
            .unwrap()
            .is_admitted()
    );
    assert!(
        store
            .charge(std::slice::from_ref(&c))
            .await
            .unwrap()
            .is_admitted()
    );
    assert!(
        !store
            .charge(std::slice::from_ref(&c))
            .await
            .unwrap()
            .is_admitted()
    );
    // The state is the server's, seen through its plain port.
    assert!(server.get_bytes(&store.redis_key(&c)).unwrap().is_some());
    // redis-rs's `#insecure` form skips verification (local tries only):
    // it reaches the same server and the same budget.
    let insecure = RedisStore::builder(&format!("{url}/#insecure"))
        .unwrap()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    assert!(!insecure.charge(&[c]).await.unwrap().is_admitted());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_or_an_expired_certificate_is_unavailable_and_spends_nothing() {
    let certs = tollgate_testkit::or_skip!(TestCertificates::generate());
    for (served, trusted, why) in [
        (
            "server.pem",
            Some("other-ca.pem"),
            "a certificate from another CA",
        ),
        ("server.pem", None, "a private CA the system does not trust"),
        ("expired.pem", Some("ca.pem"), "an expired certificate"),
    ] {
        let (server, url) = tollgate_testkit::or_skip!(tls_server(&certs, served));
        let mut builder = RedisStore::builder(&url)
            .unwrap()
            .timeout(Duration::from_secs(2));
        if let Some(ca) = trusted {
            builder = builder.tls_root_certificate(certs.read(ca));
        }
        let store = builder.build().unwrap();
        let c = charge("refused");
        let e = store.charge(std::slice::from_ref(&c)).await.unwrap_err();
        assert_eq!(
            e.kind(),
            StoreErrorKind::Unavailable,
            "{why}: {}",
            chain(&e)
        );
        assert!(
            chain(&e).to_lowercase().contains("certificate"),
            "{why}: the error says what was wrong: {}",
            chain(&e)
        );
        assert_eq!(
            server.get_bytes(&store.redis_key(&c)).unwrap(),
            None,
            "{why}: nothing spent"
        );
    }
}

/// Found in review: a file that is not a certificate was accepted at start
/// (every request then failed, for an "unknown issuer"), certificates with
/// a `redis://` URL were reported as an unsupported policy, and a URL's
/// password was repeated in error messages. Each is now a configuration
/// error at build time that says what is wrong, passwords left out.
#[test]
fn bad_tls_configuration_is_refused_at_build_with_a_reason() {
    let not_pem = RedisStore::builder("rediss://127.0.0.1:6380")
        .unwrap()
        .tls_root_certificate(b"this is not a certificate".to_vec())
        .build()
        .unwrap_err();
    assert_eq!(not_pem.kind(), StoreErrorKind::Config);
    assert!(
        chain(&not_pem).contains("no PEM certificate"),
        "{}",
        chain(&not_pem)
    );
    let plain = RedisStore::builder("redis://:s3cret@127.0.0.1:6379")
        .unwrap()
        .tls_root_certificate(b"-----BEGIN CERTIFICATE-----".to_vec())
        .build()
        .unwrap_err();
    assert_eq!(plain.kind(), StoreErrorKind::Config);
    let text = chain(&plain);
    assert!(text.contains("not a rediss:// URL"), "{text}");
    assert!(!text.contains("s3cret"), "{text}");
    let bad = RedisStore::builder("redis://user:s3cret@127.0.0.1:99999").unwrap_err();
    assert_eq!(bad.kind(), StoreErrorKind::Config);
    let text = chain(&bad);
    assert!(
        !text.contains("s3cret") && text.contains("***@127.0.0.1"),
        "{text}"
    );
    assert_eq!(
        tollgate_redis::redact_url("rediss://u:p@h:1/0"),
        "rediss://***@h:1/0"
    );
    assert_eq!(tollgate_redis::redact_url("redis://h:1"), "redis://h:1");
}

/// Found in review: a cluster over TLS could not trust a private CA
/// (`tls_root_certificate` on `cluster_builder` was a configuration
/// error). Now the certificates apply to every node, also those found
/// through the cluster's slot map: a three-node cluster with TLS on its
/// client ports and its bus (`tls-cluster yes`), charged across slots
/// through `rediss://` seeds only; with another CA, nothing is reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_with_a_private_ca() {
    use tollgate_testkit::RedisCluster;
    let certs = tollgate_testkit::or_skip!(TestCertificates::generate());
    let tls_ports: Vec<u16> = (0..3).map(|_| free_loopback_port()).collect();
    let Some(cluster) = RedisCluster::start_with(|i| {
        let mut args = certs.server_args(tls_ports[i], "server.pem");
        args.extend(["--tls-cluster".to_owned(), "yes".to_owned()]);
        args
    }) else {
        return;
    };
    // One seed: the other nodes are found through it, over TLS.
    let seed = format!("rediss://127.0.0.1:{}", tls_ports[0]);
    let store = RedisStore::cluster_builder(&[&seed])
        .unwrap()
        .tls_root_certificate(certs.read("ca.pem"))
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    // Keys on every node: each charged twice of two, then refused.
    let keys: Vec<Charge> = (0..12).map(|i| charge(&format!("node-{i}"))).collect();
    let slots: std::collections::HashSet<u16> = keys
        .iter()
        .map(|c| tollgate_testkit::slot(&store.redis_key(c)) / 5462)
        .collect();
    assert_eq!(slots.len(), 3, "the keys span the three nodes");
    for c in &keys {
        for admitted in [true, true, false] {
            let outcome = store.charge(std::slice::from_ref(c)).await.unwrap();
            assert_eq!(outcome.is_admitted(), admitted, "{:?}", c.key());
        }
    }
    // One call spanning slots, charged slot by slot.
    let fresh: Vec<Charge> = (0..3).map(|i| charge(&format!("span-{i}"))).collect();
    assert!(store.charge(&fresh).await.unwrap().is_admitted());
    // The state is on the nodes, seen through their plain ports.
    let stored = keys
        .iter()
        .filter(|c| {
            cluster.nodes().iter().any(|n| {
                n.query(&["EXISTS", &store.redis_key(c)])
                    .is_ok_and(|r| r.trim() == "1")
            })
        })
        .count();
    assert_eq!(stored, keys.len());
    // A client certificate and key are accepted with the cluster builder
    // too (the servers do not ask for one).
    let mutual = RedisStore::cluster_builder(&[&seed])
        .unwrap()
        .tls_root_certificate(certs.read("ca.pem"))
        .tls_client_certificate(certs.read("server.pem"), certs.read("server.key"))
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let c = charge("mutual");
    assert!(
        mutual
            .charge(std::slice::from_ref(&c))
            .await
            .unwrap()
            .is_admitted()
    );
    // Another CA: the handshake fails, nothing is reached.
    let wrong = RedisStore::cluster_builder(&[&seed])
        .unwrap()
        .tls_root_certificate(certs.read("other-ca.pem"))
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let e = wrong
        .charge(std::slice::from_ref(&charge("wrong-ca")))
        .await
        .unwrap_err();
    assert_ne!(e.kind(), StoreErrorKind::Config, "{}", chain(&e));
    // Certificates for plain nodes are refused when built.
    let plain = RedisStore::cluster_builder(&["redis://127.0.0.1:1"])
        .unwrap()
        .tls_root_certificate(certs.read("ca.pem"))
        .build()
        .unwrap_err();
    assert_eq!(plain.kind(), StoreErrorKind::Config);
    assert!(
        chain(&plain).contains("not a rediss:// URL"),
        "{}",
        chain(&plain)
    );
}

/// Found where features meet: two instances restarted on `rediss://`
/// answered 503 to most of their first requests now and then, since the
/// connection was made on the first call and its 200 ms included the TCP
/// connection and the TLS handshake. `connect` makes it (within its own
/// timeout) and loads every script before any request: the first call is
/// then a round trip like every later one, and a bad CA is a clear error
/// at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_makes_the_connection_and_loads_the_scripts_first() {
    let certs = tollgate_testkit::or_skip!(TestCertificates::generate());
    let (server, url) = tollgate_testkit::or_skip!(tls_server(&certs, "server.pem"));
    let store = RedisStore::builder(&url)
        .unwrap()
        .tls_root_certificate(certs.read("ca.pem"))
        .build()
        .unwrap();
    let loaded = |sha: String| server.query(&["SCRIPT", "EXISTS", &sha]).unwrap();
    assert_eq!(loaded(RedisStore::script_sha()), "0");
    store.connect().await.unwrap();
    for sha in [
        RedisStore::script_sha(),
        RedisStore::one_bucket_script_sha(),
        RedisStore::lease_script_sha(),
    ] {
        assert_eq!(loaded(sha), "1");
    }
    // The test's own inspection goes through the plain port: the store's
    // connection is the one TLS client.
    let clients = server.query(&["CLIENT", "LIST"]).unwrap();
    assert!(clients.lines().count() >= 2, "{clients}");
    let c = charge("warm");
    assert!(
        store
            .charge(std::slice::from_ref(&c))
            .await
            .unwrap()
            .is_admitted()
    );

    // A CA that does not sign the server's certificate: a clear error,
    // within the connect timeout, not a hang.
    let other = TestCertificates::generate().unwrap();
    let untrusted = RedisStore::builder(&url)
        .unwrap()
        .tls_root_certificate(other.read("ca.pem"))
        .connect_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let e = untrusted.connect().await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Unavailable, "{}", chain(&e));
    assert!(
        chain(&e).contains("connecting to Redis failed"),
        "{}",
        chain(&e)
    );
    // Nothing listening: refused at once, also a clear error.
    let nobody = RedisStore::builder(&format!("redis://127.0.0.1:{}", free_loopback_port()))
        .unwrap()
        .build()
        .unwrap();
    let e = nobody.connect().await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Unavailable, "{}", chain(&e));
}
