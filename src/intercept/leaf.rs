//! Leaf certificates per SNI name, minted on demand under the interception CA and cached, and
//! the rustls server side that presents them.
//!
//! Invariant: a leaf is minted only for a DNS name the CA's constraints permit (otherwise an
//! error, and the handshake fails: never a leaf for another name, never one for an address);
//! a cached leaf is always within its validity (the cache forgets it at half its lifetime);
//! the cache holds at most its capacity.

use super::ca::{random_serial, CaError, InterceptCa};
use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose,
};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use std::sync::Arc;
use std::time::Duration;
use time::OffsetDateTime;

/// How long a leaf is valid.
pub const LEAF_VALIDITY: Duration = Duration::from_secs(24 * 3600);
/// How far before now a leaf's validity starts, for clients whose clocks run behind.
pub const LEAF_BACKDATE: Duration = Duration::from_secs(5 * 60);
/// How many leaves the cache holds by default.
pub const CACHE_CAPACITY: u64 = 10_000;

/// Mints and caches leaves under one CA.
pub struct LeafMinter {
    ca: InterceptCa,
    /// SNI name (normalised) → its leaf; bounded, entries forgotten at half a leaf's lifetime.
    cache: moka::sync::Cache<String, Arc<CertifiedKey>>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl std::fmt::Debug for LeafMinter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeafMinter")
            .field("ca", &self.ca)
            .field("cached", &self.cache.entry_count())
            .finish_non_exhaustive()
    }
}

impl LeafMinter {
    /// A minter with the default cache capacity.
    pub fn new(ca: InterceptCa) -> LeafMinter {
        LeafMinter::with_capacity(ca, CACHE_CAPACITY)
    }

    /// A minter whose cache holds at most `capacity` leaves.
    pub fn with_capacity(ca: InterceptCa, capacity: u64) -> LeafMinter {
        LeafMinter {
            ca,
            cache: moka::sync::Cache::builder()
                .max_capacity(capacity)
                .time_to_live(LEAF_VALIDITY / 2)
                .build(),
            provider: Arc::new(rustls::crypto::ring::default_provider()),
        }
    }

    pub fn ca(&self) -> &InterceptCa {
        &self.ca
    }

    /// The leaf for `name`, from the cache or minted now (concurrent callers for one name share
    /// one minting). A name the CA does not permit is an error.
    pub fn leaf(&self, name: &str) -> Result<Arc<CertifiedKey>, Arc<CaError>> {
        let name = self
            .ca
            .permits(name)
            .ok_or_else(|| Arc::new(CaError::NotPermitted(name.to_owned())))?;
        self.cache
            .try_get_with_by_ref(&name, || self.mint(&name).map(Arc::new))
    }

    /// How many leaves the cache holds now (after pending evictions run).
    pub fn cached(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.entry_count()
    }

    /// A new leaf for a permitted, normalised `name`: ECDSA P-256, SAN `name`, serverAuth,
    /// valid from [`LEAF_BACKDATE`] ago for [`LEAF_VALIDITY`] or until the CA expires.
    fn mint(&self, name: &str) -> Result<CertifiedKey, CaError> {
        let now = OffsetDateTime::now_utc();
        if now >= self.ca.not_after {
            return Err(CaError::Expired(self.ca.not_after));
        }
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::new(vec![name.to_owned()])?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = now - LEAF_BACKDATE;
        params.not_after = (now + LEAF_VALIDITY).min(self.ca.not_after);
        params.serial_number = Some(random_serial());
        let cert = params.signed_by(&key, &self.ca.issuer, &self.ca.key)?;
        let private = rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
        let signing = self.provider.key_provider.load_private_key(private)?;
        Ok(CertifiedKey::new(vec![cert.der().clone()], signing))
    }
}

/// Presents the minted leaf for the client's SNI name. No SNI, or a name the CA does not
/// permit: no certificate, so the handshake fails.
#[derive(Debug)]
pub struct LeafResolver(pub Arc<LeafMinter>);

impl ResolvesServerCert for LeafResolver {
    fn resolve(&self, client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let Some(name) = client_hello.server_name() else {
            tracing::warn!("interception handshake without SNI refused");
            return None;
        };
        match self.0.leaf(name) {
            Ok(leaf) => Some(leaf),
            Err(e) => {
                tracing::warn!(sni = name, error = %e, "interception handshake refused");
                None
            }
        }
    }
}

/// The client-facing TLS configuration of a terminated tunnel: leaves from `minter`, ALPN
/// offering HTTP/2 then HTTP/1.1.
pub fn server_config(minter: Arc<LeafMinter>) -> Result<rustls::ServerConfig, rustls::Error> {
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_cert_resolver(Arc::new(LeafResolver(minter)));
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::intercept::ca;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

    /// A CA for `patterns`, written to and loaded back from a temporary directory.
    fn ca_for(patterns: &[&str]) -> InterceptCa {
        let dir = tempfile::tempdir().unwrap();
        let patterns: Vec<String> = patterns.iter().map(|p| p.to_string()).collect();
        let made = ca::make(&patterns, Duration::from_secs(3600)).unwrap();
        ca::write(&made, dir.path(), false).unwrap();
        InterceptCa::load_dir(dir.path()).unwrap()
    }

    /// What a client trusting only `ca` says of `leaf` presented for `name`.
    fn verify(ca: &InterceptCa, leaf: &CertificateDer<'_>, name: &str) -> Result<(), String> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.cert_der().clone()).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        verifier
            .verify_server_cert(
                leaf,
                &[],
                &ServerName::try_from(name.to_owned()).unwrap(),
                &[],
                UnixTime::now(),
            )
            .map(|_| ())
            .map_err(|e| format!("{e:?}"))
    }

    /// A leaf for `san` signed by the CA directly, bypassing the minter's refusal: what a
    /// stolen CA key could make.
    fn forced_leaf(ca: &InterceptCa, san: rcgen::SanType) -> CertificateDer<'static> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![san];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        params
            .signed_by(&key, &ca.issuer, &ca.key)
            .unwrap()
            .der()
            .clone()
    }

    #[test]
    fn a_minted_leaf_verifies_against_the_ca_for_its_name() {
        let minter = LeafMinter::new(ca_for(&["*.example.test", "origin.test"]));
        for name in ["api.example.test", "a.b.example.test", "origin.test"] {
            let leaf = minter.leaf(name).unwrap();
            assert_eq!(verify(minter.ca(), &leaf.cert[0], name), Ok(()), "{name}");
        }
        // The same leaf is no good for another name.
        let leaf = minter.leaf("api.example.test").unwrap();
        let other = verify(minter.ca(), &leaf.cert[0], "web.example.test").unwrap_err();
        assert!(other.contains("NotValidForName"), "{other}");
    }

    #[test]
    fn a_leaf_outside_the_name_constraints_is_rejected_by_a_client() {
        let ca = ca_for(&["*.example.test"]);
        let inside = forced_leaf(
            &ca,
            rcgen::SanType::DnsName("in.example.test".try_into().unwrap()),
        );
        assert_eq!(verify(&ca, &inside, "in.example.test"), Ok(()));
        for name in ["bank.test", "example.test.evil.test", "notexample.test"] {
            let leaf = forced_leaf(&ca, rcgen::SanType::DnsName(name.try_into().unwrap()));
            let refused = verify(&ca, &leaf, name).unwrap_err();
            assert!(
                refused.contains("NameConstraintViolation"),
                "{name}: {refused}"
            );
        }
    }

    #[test]
    fn a_leaf_for_an_ip_address_is_rejected_by_a_client() {
        let ca = ca_for(&["*.example.test"]);
        for ip in ["127.0.0.1", "10.0.0.1", "::1"] {
            let addr: std::net::IpAddr = ip.parse().unwrap();
            let leaf = forced_leaf(&ca, rcgen::SanType::IpAddress(addr));
            let refused = verify(&ca, &leaf, ip).unwrap_err();
            assert!(
                refused.contains("NameConstraintViolation"),
                "{ip}: {refused}"
            );
        }
    }

    #[test]
    fn the_minter_refuses_names_outside_the_patterns() {
        let minter = LeafMinter::new(ca_for(&["*.example.test", "origin.test"]));
        for name in [
            "bank.test",
            "notexample.test",
            "example.test.evil.test",
            "127.0.0.1",
            "::1",
            "",
            "a b.example.test",
        ] {
            let refused = minter.leaf(name).unwrap_err();
            assert!(
                matches!(*refused, CaError::NotPermitted(_)),
                "{name}: {refused}"
            );
        }
        assert_eq!(minter.cached(), 0);
        // Case and one trailing dot are folded, as in targets.
        let leaf = minter.leaf("API.Example.Test.").unwrap();
        assert_eq!(
            verify(minter.ca(), &leaf.cert[0], "api.example.test"),
            Ok(())
        );
    }

    #[test]
    fn the_cache_returns_the_same_leaf_and_stays_bounded() {
        let minter = LeafMinter::with_capacity(ca_for(&["*.example.test"]), 4);
        let first = minter.leaf("a.example.test").unwrap();
        assert!(Arc::ptr_eq(&first, &minter.leaf("a.example.test").unwrap()));
        assert!(Arc::ptr_eq(&first, &minter.leaf("A.example.test").unwrap()));
        assert!(!Arc::ptr_eq(
            &first,
            &minter.leaf("b.example.test").unwrap()
        ));
        for i in 0..40 {
            minter.leaf(&format!("n{i}.example.test")).unwrap();
        }
        assert!(minter.cached() <= 4, "{} cached", minter.cached());
    }

    #[test]
    fn the_server_config_offers_h2_then_http1() {
        let minter = Arc::new(LeafMinter::new(ca_for(&["origin.test"])));
        let config = server_config(minter).unwrap();
        assert_eq!(
            config.alpn_protocols,
            [b"h2".to_vec(), b"http/1.1".to_vec()]
        );
    }
}
