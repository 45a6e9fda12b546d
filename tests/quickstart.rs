//! The field notes' identity checks, as HTTP against the quickstart binary
//! (a black box over loopback): who shares a budget and who cannot reset one.

mod common;

use common::{Reply, ip, param, quickstart, send, sf_list};
use http::StatusCode;

const ALICE: (&str, &str) = ("Authorization", "Bearer alice-key-1");
const ALICE_ROTATED: (&str, &str) = ("Authorization", "Bearer alice-key-2");
const BOB: (&str, &str) = ("Authorization", "Bearer bob-key");
const CAROL: (&str, &str) = ("Authorization", "Bearer carol-key");

async fn export(server: std::net::SocketAddr, from: &str, headers: &[(&str, &str)]) -> Reply {
    send(server, ip(from), "POST", "/export", headers, b"").await
}

#[tokio::test(flavor = "multi_thread")]
async fn accounts_behind_one_address_share_its_budget_but_not_their_own() {
    let q = quickstart(&[]);
    let a = q.addr;
    // Alice spends her account budget of 3 from one address.
    for _ in 0..3 {
        assert_eq!(
            export(a, "127.0.1.1", &[ALICE]).await.status,
            StatusCode::OK
        );
    }
    assert_eq!(
        export(a, "127.0.1.1", &[ALICE]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Bob, behind the same address, has his own account budget...
    assert_eq!(export(a, "127.0.1.1", &[BOB]).await.status, StatusCode::OK);
    // ...but the address budget of 5 is shared: 3 + 1 spent (the refusal
    // spent nothing), one left, then the address is exhausted for everyone.
    assert_eq!(
        send(a, ip("127.0.1.1"), "GET", "/", &[], b"").await.status,
        StatusCode::OK
    );
    let r = export(a, "127.0.1.1", &[CAROL]).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    let limits = sf_list(r.header("ratelimit").unwrap());
    let per_ip = limits.iter().find(|m| m.0 == "per-ip").unwrap();
    assert_eq!(param(per_ip, "r"), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn new_address_rotated_credential_or_forged_claim_does_not_reset_the_account() {
    let q = quickstart(&[]);
    let a = q.addr;
    for _ in 0..3 {
        assert_eq!(
            export(a, "127.0.2.1", &[ALICE]).await.status,
            StatusCode::OK
        );
    }
    // Roaming to a fresh address: new address budget, same account budget.
    let roamed = export(a, "127.0.2.2", &[ALICE]).await;
    assert_eq!(roamed.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        send(a, ip("127.0.2.2"), "GET", "/", &[], b"").await.status,
        StatusCode::OK
    );
    // A rotated credential of the same account.
    assert_eq!(
        export(a, "127.0.2.3", &[ALICE_ROTATED]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Account claims in headers and query strings change nothing.
    for claim in ["bob", "new-account", "admin"] {
        let r = export(
            a,
            "127.0.2.4",
            &[
                ALICE,
                ("X-Account", claim),
                ("X-Tenant", "south"),
                ("X-User-Id", claim),
            ],
        )
        .await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "claim {claim}");
        let r = send(
            a,
            ip("127.0.2.5"),
            "POST",
            &format!("/export?account={claim}"),
            &[ALICE],
            b"",
        )
        .await;
        assert_eq!(
            r.status,
            StatusCode::TOO_MANY_REQUESTS,
            "query claim {claim}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn tenants_are_separate_and_missing_credentials_are_refused() {
    let q = quickstart(&[]);
    let a = q.addr;
    for _ in 0..3 {
        assert_eq!(
            export(a, "127.0.3.1", &[ALICE]).await.status,
            StatusCode::OK
        );
    }
    // (south, alice) is another account than (north, alice).
    assert_eq!(
        export(a, "127.0.3.2", &[CAROL]).await.status,
        StatusCode::OK
    );
    // Unknown and missing keys on a principal route.
    assert_eq!(
        export(a, "127.0.3.3", &[("Authorization", "Bearer nope")])
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        export(a, "127.0.3.3", &[]).await.status,
        StatusCode::UNAUTHORIZED
    );
    // A bearer key is never a budget key; but every request counts against
    // its address, the 401s too: two of the address budget of 5 are spent,
    // and this request spends a third.
    assert_eq!(
        send(a, ip("127.0.3.3"), "GET", "/", &[], b"")
            .await
            .header("ratelimit")
            .map(sf_list)
            .unwrap()[0]
            .1
            .iter()
            .find(|(k, _)| k == "r")
            .map(|(_, v)| v.clone()),
        Some("2".to_owned())
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn untrusted_peer_cannot_choose_its_forwarded_address() {
    let q = quickstart(&[]);
    for i in 0..5 {
        let xff = format!("203.0.113.{i}");
        let r = send(
            q.addr,
            ip("127.0.4.1"),
            "GET",
            "/",
            &[("X-Forwarded-For", &xff)],
            b"",
        )
        .await;
        assert_eq!(r.status, StatusCode::OK);
    }
    let r = send(
        q.addr,
        ip("127.0.4.1"),
        "GET",
        "/",
        &[("X-Forwarded-For", "203.0.113.99")],
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test(flavor = "multi_thread")]
async fn trusted_proxy_forwarding_and_equivalent_ipv6_spellings_share_a_key() {
    let q = quickstart(&["--trust-proxy", "127.0.5.1/32"]);
    let proxy = ip("127.0.5.1");
    let spellings = [
        "2001:db8::1",
        "2001:0db8:0:0::1",
        "2001:db8:0:0:0:0:0:1",
        "[2001:db8::1]:4711",
        "2001:DB8::1",
    ];
    for s in spellings {
        let r = send(q.addr, proxy, "GET", "/", &[("X-Forwarded-For", s)], b"").await;
        assert_eq!(r.status, StatusCode::OK, "{s}");
    }
    let r = send(
        q.addr,
        proxy,
        "GET",
        "/",
        &[("X-Forwarded-For", "2001:db8::0:1")],
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    // Another client behind the same proxy has its own budget, and a client
    // that prepends a forged address is keyed by what the proxy saw.
    let r = send(
        q.addr,
        proxy,
        "GET",
        "/",
        &[("X-Forwarded-For", "6.6.6.6, 198.51.100.7")],
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    // IPv4-mapped IPv6 is the IPv4 client.
    for _ in 0..4 {
        let r = send(
            q.addr,
            proxy,
            "GET",
            "/",
            &[("X-Forwarded-For", "::ffff:198.51.100.7")],
            b"",
        )
        .await;
        assert_eq!(r.status, StatusCode::OK);
    }
    let r = send(
        q.addr,
        proxy,
        "GET",
        "/",
        &[("X-Forwarded-For", "198.51.100.7")],
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test(flavor = "multi_thread")]
async fn refusal_headers_parse_as_structured_fields() {
    let q = quickstart(&[]);
    for _ in 0..3 {
        export(q.addr, "127.0.6.1", &[ALICE]).await;
    }
    let r = export(q.addr, "127.0.6.1", &[ALICE]).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(retry >= 1, "Retry-After must be positive, got {retry}");
    assert_eq!(r.header("cache-control"), Some("no-store"));
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert!(r.body.contains("\"status\":429"), "{}", r.body);
    assert!(r.body.contains("\"policy\":\"export\""), "{}", r.body);

    let policies = sf_list(r.header("ratelimit-policy").unwrap());
    let names: Vec<&str> = policies.iter().map(|m| m.0.as_str()).collect();
    assert_eq!(names, ["per-ip", "export"]);
    assert_eq!(
        (param(&policies[0], "q"), param(&policies[0], "w")),
        (Some(5), Some(5))
    );
    assert_eq!(
        (param(&policies[1], "q"), param(&policies[1], "w")),
        (Some(3), Some(2))
    );
    let current = sf_list(r.header("ratelimit").unwrap());
    let export_now = current.iter().find(|m| m.0 == "export").unwrap();
    assert_eq!(param(export_now, "r"), Some(0));
    assert!(param(export_now, "t").unwrap() >= 1);
    // The refused request spent nothing from the address budget (3 of 5 used).
    let per_ip = current.iter().find(|m| m.0 == "per-ip").unwrap();
    assert_eq!(param(per_ip, "r"), Some(2));

    // Admitted responses carry the fields too.
    let ok = send(q.addr, ip("127.0.6.2"), "GET", "/", &[], b"").await;
    assert_eq!(ok.status, StatusCode::OK);
    assert_eq!(
        param(&sf_list(ok.header("ratelimit").unwrap())[0], "r"),
        Some(4)
    );
    assert!(ok.header("retry-after").is_none());
}

#[tokio::test(flavor = "multi_thread")]
async fn upload_costs_kib_and_oversized_bodies_never_fit() {
    let q = quickstart(&[]);
    let r = send(
        q.addr,
        ip("127.0.7.1"),
        "POST",
        "/upload",
        &[BOB],
        &vec![b'x'; 10 * 1024 + 1],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let upload = sf_list(r.header("ratelimit").unwrap())
        .into_iter()
        .find(|m| m.0 == "upload")
        .unwrap();
    assert!(param(&upload, "r").unwrap() <= 1024 - 11);

    // Carol's account starts full: exactly 1 MiB fits and empties it.
    let mib = vec![b'x'; 1024 * 1024];
    let r = send(q.addr, ip("127.0.7.2"), "POST", "/upload", &[CAROL], &mib).await;
    assert_eq!(r.status, StatusCode::OK);
    // One byte more can never fit: 413, no Retry-After, nothing spent.
    let big = vec![b'x'; 1024 * 1024 + 1];
    let r = send(q.addr, ip("127.0.7.2"), "POST", "/upload", &[CAROL], &big).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(r.header("retry-after").is_none());
    assert_eq!(r.header("cache-control"), Some("no-store"));
    assert!(r.body.contains("can never be admitted"), "{}", r.body);
    // Another full MiB is an ordinary refusal with a wait (4 s of refill).
    let r = send(q.addr, ip("127.0.7.2"), "POST", "/upload", &[CAROL], &mib).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=4).contains(&retry), "{retry}");
}
