//! etcd with TLS and with user/password auth, for real: `etcds://` verifies the members
//! against the operator's CA (and refuses them without it), a login with the right password
//! works and one with a wrong password is refused, with a clear message and no password in
//! it.

use std::time::Duration;

use fastbox_state::{EtcdBackend, EtcdOptions, StateBackend, StateError, StateUrl};
use fastbox_testkit::etcd::{EtcdCluster, etcd_unavailable};

fn connect(url: &str, options: EtcdOptions) -> Result<EtcdBackend, StateError> {
    let StateUrl::Etcd(target) = StateUrl::parse(url).unwrap() else {
        unreachable!()
    };
    EtcdBackend::connect(target, options)
}

#[test]
fn tls_members_are_verified_against_the_operators_ca() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start_tls(1).expect("etcd with TLS");
    let url = format!("{}/fbt-tls", etcd.state_url());
    assert!(url.starts_with("etcds://"), "{url}");
    let store = connect(
        &url,
        EtcdOptions {
            ca: Some(etcd.ca_file().unwrap().to_path_buf()),
            ..EtcdOptions::default()
        },
    )
    .expect("verified against the CA");
    let r = store.put("sandboxes", "a", b"over tls", 0, None).unwrap();
    assert_eq!(store.get("sandboxes", "a").unwrap().unwrap().revision, r);

    // The system's roots do not know this CA: nothing is sent.
    let refused = connect(
        &url,
        EtcdOptions {
            timeout: Duration::from_secs(2),
            ..EtcdOptions::default()
        },
    )
    .err()
    .expect("an unknown CA is refused");
    assert!(refused.is_unavailable(), "{refused}");
    // Plain HTTP to a TLS member gets nowhere either.
    let plain = connect(
        &url.replacen("etcds://", "etcd://", 1),
        EtcdOptions {
            timeout: Duration::from_secs(2),
            ..EtcdOptions::default()
        },
    );
    assert!(plain.is_err());
}

#[test]
fn a_login_with_the_right_password_works_and_a_wrong_one_is_refused() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let etcd = EtcdCluster::start(1).expect("etcd");
    // Auth on, with a root user (etcd's own API).
    for (path, body) in [
        ("/v3/auth/role/add", r#"{"name":"root"}"#),
        (
            "/v3/auth/user/add",
            r#"{"name":"root","password":"s3cret-pw"}"#,
        ),
        ("/v3/auth/user/grant", r#"{"user":"root","role":"root"}"#),
        ("/v3/auth/enable", "{}"),
    ] {
        etcd.post(0, path, body)
            .unwrap_or_else(|e| panic!("{path}: {e}"));
    }
    let members = etcd.state_url().replacen("etcd://", "", 1);
    let store = connect(
        &format!("etcd://root:s3cret-pw@{members}/fbt-auth"),
        EtcdOptions::default(),
    )
    .expect("logged in");
    store
        .put("sandboxes", "a", b"authenticated", 0, None)
        .unwrap();
    assert_eq!(
        store.get("sandboxes", "a").unwrap().unwrap().value,
        b"authenticated"
    );

    let wrong = connect(
        &format!("etcd://root:not-it@{members}/fbt-auth"),
        EtcdOptions::default(),
    )
    .err()
    .expect("a wrong password is refused");
    let text = wrong.to_string();
    assert!(text.contains("login refused"), "{text}");
    assert!(!text.contains("not-it"), "{text}");
    // Without a user, etcd refuses the calls.
    let anonymous = connect(
        &format!("etcd://{members}/fbt-auth"),
        EtcdOptions {
            timeout: Duration::from_secs(2),
            ..EtcdOptions::default()
        },
    );
    assert!(anonymous.is_err());
}
