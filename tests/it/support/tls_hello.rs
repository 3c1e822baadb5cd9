//! ClientHello bytes for tests: what a rustls client sends first, and the same handshake
//! re-framed into records of any size. Shared by the hello reader's unit tests
//! (`src/proxy/hello.rs`) and the integration tests (`boundary_tls.rs`).
//!
//! Invariant: `reframe` keeps the handshake bytes exactly; only the record boundaries move.

#![allow(dead_code)] // each of the two crates that include this uses part of it

use base64::Engine as _;
use std::sync::Arc;

/// A rustls client for `name` trusting `ca` (PEM; none: nothing is trusted), offering `alpn`.
pub fn tls_client(
    name: &str,
    ca: Option<&std::path::Path>,
    alpn: Vec<Vec<u8>>,
) -> rustls::ClientConnection {
    let name = rustls::pki_types::ServerName::try_from(name.to_owned()).unwrap();
    rustls::ClientConnection::new(client_config(ca, alpn), name).unwrap()
}

/// A rustls client configuration trusting `ca` (PEM, one certificate; none: nothing is
/// trusted), offering `alpn`.
pub fn client_config(
    ca: Option<&std::path::Path>,
    alpn: Vec<Vec<u8>>,
) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    if let Some(ca) = ca {
        let pem = std::fs::read_to_string(ca).unwrap();
        let b64: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        let der = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        roots.add(der.into()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = alpn;
    Arc::new(config)
}

/// The records a rustls client sends first (its ClientHello).
pub fn first_flight(conn: &mut rustls::ClientConnection) -> Vec<u8> {
    let mut out = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut out).unwrap();
    }
    out
}

/// The same handshake bytes as `records`, re-framed `size` bytes per record.
pub fn reframe(records: &[u8], size: usize) -> Vec<u8> {
    let mut handshake = Vec::new();
    let mut at = 0;
    while at < records.len() {
        assert_eq!(records[at], 22, "only handshake records expected");
        let len = usize::from(u16::from_be_bytes([records[at + 3], records[at + 4]]));
        handshake.extend_from_slice(&records[at + 5..at + 5 + len]);
        at += 5 + len;
    }
    let mut out = Vec::new();
    for chunk in handshake.chunks(size) {
        out.extend_from_slice(&[22, 3, 1]);
        out.extend_from_slice(&(chunk.len() as u16).to_be_bytes());
        out.extend_from_slice(chunk);
    }
    out
}

/// What a rustls client sends first for `sni`, offering `alpn`.
pub fn client_hello(sni: &str, alpn: Vec<Vec<u8>>) -> Vec<u8> {
    first_flight(&mut tls_client(sni, None, alpn))
}
