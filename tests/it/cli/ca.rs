//! `leasegate ca init` and the leaves minted under its CA: the key is the proxy's alone (mode
//! 0600, never overwritten by accident), and a real client that trusts the CA completes a
//! handshake for a permitted name and fails one for any other.

use crate::support::harness::curl;
use crate::support::{leasegate, succeeded};
use leasegate::intercept::{server_config, InterceptCa, LeafMinter};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ANSWER: &str =
    "HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: close\r\n\r\nhello origin";

fn mode(path: &Path) -> u32 {
    path.metadata().unwrap().permissions().mode() & 0o777
}

#[tokio::test]
async fn ca_init_writes_a_private_key_and_refuses_to_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let ca_dir = dir.path().join("ca");
    let ca = ca_dir.to_str().unwrap();
    let (cert, key) = (ca_dir.join("ca.pem"), ca_dir.join("ca-key.pem"));

    let refused = leasegate(&["ca", "init", "--dir", ca, "--host", "*"]).await;
    assert_eq!(refused.status.code(), Some(1));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("vouch for every name"), "{said}");
    assert!(!cert.exists() && !key.exists());

    let out = succeeded(
        &leasegate(&[
            "ca",
            "init",
            "--dir",
            ca,
            "--host",
            "*.example.test,origin.test",
        ])
        .await,
    );
    assert!(
        out.contains(&format!("certificate: {}", cert.display())),
        "{out}"
    );
    assert!(
        out.contains("permits:     example.test, origin.test"),
        "{out}"
    );
    let fingerprint = out
        .lines()
        .find_map(|l| l.strip_prefix("sha256:"))
        .unwrap()
        .trim();
    assert_eq!(fingerprint.len(), 32 * 3 - 1, "{out}");
    assert!(!out.contains("PRIVATE"), "{out}");
    assert_eq!(mode(&key), 0o600);
    assert_eq!(mode(&ca_dir), 0o700);
    let first = std::fs::read(&cert).unwrap();
    assert!(first.starts_with(b"-----BEGIN CERTIFICATE-----"));
    let first_key = std::fs::read(&key).unwrap();

    let again = leasegate(&["ca", "init", "--dir", ca, "--host", "origin.test"]).await;
    assert_eq!(again.status.code(), Some(1));
    let said = String::from_utf8_lossy(&again.stderr);
    assert!(
        said.contains("exists (pass --force to replace it)"),
        "{said}"
    );
    assert_eq!(std::fs::read(&cert).unwrap(), first);
    assert_eq!(std::fs::read(&key).unwrap(), first_key);

    succeeded(
        &leasegate(&[
            "ca",
            "init",
            "--dir",
            ca,
            "--host",
            "origin.test",
            "--force",
        ])
        .await,
    );
    assert_ne!(std::fs::read(&cert).unwrap(), first);
    assert_ne!(std::fs::read(&key).unwrap(), first_key);
    assert_eq!(mode(&key), 0o600);
}

/// A TLS origin on loopback presenting leaves from `minter`, answering [`ANSWER`] to each
/// request; its port.
async fn minting_origin(minter: Arc<LeafMinter>) -> u16 {
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_config(minter).unwrap()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(stream).await else {
                    return;
                };
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tls.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = tls.write_all(ANSWER.as_bytes()).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    port
}

#[tokio::test]
async fn curl_trusts_a_minted_leaf_for_a_permitted_name_only() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().to_str().unwrap();
    succeeded(&leasegate(&["ca", "init", "--dir", ca, "--host", "origin.test"]).await);
    let minter = Arc::new(LeafMinter::new(InterceptCa::load_dir(dir.path()).unwrap()));
    let port = minting_origin(minter.clone()).await;
    let ca_pem = dir.path().join("ca.pem");
    let ca_pem = ca_pem.to_str().unwrap();

    let get = |name: &'static str| {
        let resolve = format!("{name}:{port}:127.0.0.1");
        let url = format!("https://{name}:{port}/");
        async move {
            curl(
                &["--cacert", ca_pem, "--resolve", &resolve, "--http1.1", &url],
                &[],
            )
            .await
        }
    };
    let ok = get("origin.test").await;
    assert_eq!(
        (ok.status, ok.body_text().as_str()),
        (200, "hello origin"),
        "{}",
        ok.stderr
    );

    // No leaf for a name outside the CA's constraints: the handshake fails (curl exit 35).
    let refused = get("other.test").await;
    assert_eq!(
        (refused.status, refused.exit),
        (0, 35),
        "{}",
        refused.stderr
    );
    assert_eq!(minter.cached(), 1);
}
