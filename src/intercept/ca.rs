//! The interception CA: made by `leasegate ca init` from the terminated host patterns, and
//! loaded back from its two PEM files for the leaf minter.
//!
//! Invariant: a CA made here is name-constrained — permitted dNSName subtrees from the patterns,
//! every IPv4 and IPv6 address excluded — and a CA is loaded only when it carries permitted
//! dNSName constraints and its key is its own; [`InterceptCa::permits`] says yes only to DNS
//! names inside those subtrees, so nothing here vouches for a name the certificate cannot.

/// The variables an agent's clients read a trust bundle from, pointed at a file holding the
/// system's roots and the interception CA (`run` writes it; the `POST /leases` answer names
/// them).
pub const BUNDLE_VARS: [&str; 4] = [
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "GIT_SSL_CAINFO",
];

/// Node adds `NODE_EXTRA_CA_CERTS` to its own roots: pointed at the CA alone.
pub const CA_VAR: &str = "NODE_EXTRA_CA_CERTS";

use crate::durable::create_new;
use crate::policy::{HostPattern, TargetHost};
use rcgen::{
    BasicConstraints, CertificateParams, CidrSubnet, DistinguishedName, DnType, GeneralSubtree,
    IsCa, KeyPair, KeyUsagePurpose, NameConstraints, SerialNumber,
};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::Duration;
use time::OffsetDateTime;

/// The certificate's file name in the CA directory.
pub const CA_CERT_FILE: &str = "ca.pem";
/// The key's file name in the CA directory (mode 0600).
pub const CA_KEY_FILE: &str = "ca-key.pem";

const CA_COMMON_NAME: &str = "leasegate interception CA";
/// The longest a CA may be valid: a century, far inside X.509's year 9999.
pub const MAX_VALIDITY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Why a CA could not be made, written, loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("{0}")]
    Pattern(#[from] crate::policy::pattern::MalformedPattern),
    #[error("no host pattern: name the hosts the CA may vouch for (--host)")]
    NoPatterns,
    #[error("'*' would let the CA vouch for every name: list the hosts to terminate")]
    Everything,
    #[error("'{0}' is an IP address: the CA vouches for no address, only DNS names")]
    AddressPattern(String),
    #[error("a CA's validity must be longer than zero and at most 100 years")]
    Validity,
    #[error("{0} exists (pass --force to replace it)")]
    Exists(PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {why}")]
    Unusable { path: PathBuf, why: String },
    #[error("certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    #[error("the CA expired at {0}")]
    Expired(OffsetDateTime),
    #[error("'{0}' is not a DNS name the CA may vouch for (its name constraints exclude it)")]
    NotPermitted(String),
    #[error("leaf key: {0}")]
    LeafKey(#[from] rustls::Error),
}

/// The dNSName subtree each pattern needs: `*.example.test` → `example.test`, `api.example.test`
/// → `api.example.test` (a dNSName constraint also permits the subdomains of its name, so an
/// exact pattern lets the CA vouch for `x.api.example.test` too). `*` and IP literals are
/// refused: the CA would vouch for every name, or for an address.
pub fn permitted_subtrees(patterns: &[String]) -> Result<Vec<String>, CaError> {
    if patterns.is_empty() {
        return Err(CaError::NoPatterns);
    }
    let mut subtrees = Vec::new();
    for text in patterns {
        let name = match HostPattern::parse(text)? {
            HostPattern::Any => return Err(CaError::Everything),
            HostPattern::Subdomains(suffix) => suffix,
            HostPattern::Exact(name) => match crate::policy::target::parse_host(&name) {
                Ok(TargetHost::Name(name)) => name,
                _ => return Err(CaError::AddressPattern(text.clone())),
            },
        };
        if !subtrees.contains(&name) {
            subtrees.push(name);
        }
    }
    Ok(subtrees)
}

/// A CA freshly made: its certificate and key as PEM, the DNS subtrees it permits, and the
/// certificate's fingerprint.
pub struct NewCa {
    pub cert_pem: String,
    pub subtrees: Vec<String>,
    /// The private key, PKCS#8 PEM: written once, mode 0600, never printed.
    pub key_pem: String,
    pub fingerprint: String,
}

impl std::fmt::Debug for NewCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewCa")
            .field("subtrees", &self.subtrees)
            .field("fingerprint", &self.fingerprint)
            .field("key_pem", &"[redacted]")
            .finish_non_exhaustive()
    }
}

/// Makes a CA for `patterns` (see [`permitted_subtrees`]): ECDSA P-256, CA with path length 0,
/// key usage certificate and CRL signing, valid from now for `validity` (at most
/// [`MAX_VALIDITY`]).
pub fn make(patterns: &[String], validity: Duration) -> Result<NewCa, CaError> {
    if validity.is_zero() || validity > MAX_VALIDITY {
        return Err(CaError::Validity);
    }
    let subtrees = permitted_subtrees(patterns)?;
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_COMMON_NAME);
    dn.push(DnType::OrganizationName, "leasegate");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params.name_constraints = Some(NameConstraints {
        permitted_subtrees: subtrees
            .iter()
            .cloned()
            .map(GeneralSubtree::DnsName)
            .collect(),
        excluded_subtrees: vec![
            GeneralSubtree::IpAddress(CidrSubnet::from_v4_prefix([0; 4], 0)),
            GeneralSubtree::IpAddress(CidrSubnet::from_v6_prefix([0; 16], 0)),
        ],
    });
    let now = OffsetDateTime::now_utc();
    params.not_before = now;
    params.not_after = now + validity;
    params.serial_number = Some(random_serial());
    let cert = params.self_signed(&key)?;
    Ok(NewCa {
        cert_pem: cert.pem(),
        subtrees,
        key_pem: key.serialize_pem(),
        fingerprint: fingerprint(cert.der()),
    })
}

/// Writes `ca` into `dir` (made mode 0700 if missing): the key first, created mode 0600 (never
/// written wider and narrowed after), then the certificate. Without `force`, an existing file
/// is refused before anything is written; with it, the old files are removed first.
pub fn write(ca: &NewCa, dir: &Path, force: bool) -> Result<(PathBuf, PathBuf), CaError> {
    use std::os::unix::fs::DirBuilderExt;
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| CaError::Io { path, source }
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io(dir))?;
    let cert = dir.join(CA_CERT_FILE);
    let key = dir.join(CA_KEY_FILE);
    for path in [&key, &cert] {
        match (path.symlink_metadata(), force) {
            (Ok(_), false) => return Err(CaError::Exists(path.clone())),
            (Ok(_), true) => std::fs::remove_file(path).map_err(io(path))?,
            (Err(_), _) => {}
        }
    }
    create_new(&key, 0o600, ca.key_pem.as_bytes()).map_err(io(&key))?;
    create_new(&cert, 0o644, ca.cert_pem.as_bytes()).map_err(io(&cert))?;
    Ok((cert, key))
}

/// A certificate's SHA-256 fingerprint as `openssl x509 -fingerprint -sha256` prints it.
pub fn fingerprint(der: &[u8]) -> String {
    let digest = Sha256::digest(der);
    let hex: Vec<String> = digest.iter().map(|b| format!("{b:02X}")).collect();
    hex.join(":")
}

/// A positive 128-bit serial number.
pub(super) fn random_serial() -> SerialNumber {
    let mut bytes: [u8; 16] = rand::random();
    bytes[0] &= 0x7f;
    SerialNumber::from_slice(&bytes)
}

/// The CA loaded for signing leaves: its certificate, the issuer rcgen signs as, its key and
/// the DNS subtrees its name constraints permit.
pub struct InterceptCa {
    /// The certificate as loaded (a client's trust anchor; its fingerprint in logs).
    pub(super) der: rustls::pki_types::CertificateDer<'static>,
    /// The issuer rcgen signs leaves as: the loaded subject and key identifier (its own DER is
    /// a re-signing, never served).
    pub(super) issuer: rcgen::Certificate,
    pub(super) key: KeyPair,
    /// Permitted dNSName subtrees, lower-case: the only names a leaf may carry.
    subtrees: Vec<String>,
    pub(super) not_after: OffsetDateTime,
}

impl std::fmt::Debug for InterceptCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InterceptCa")
            .field("fingerprint", &fingerprint(&self.der))
            .field("subtrees", &self.subtrees)
            .field("key", &"[redacted]")
            .finish_non_exhaustive()
    }
}

impl InterceptCa {
    /// `ca.pem` and `ca-key.pem` in `dir`.
    pub fn load_dir(dir: &Path) -> Result<InterceptCa, CaError> {
        InterceptCa::load(&dir.join(CA_CERT_FILE), &dir.join(CA_KEY_FILE))
    }

    /// Loads a CA certificate and its key. Refused (fail closed): a certificate that is not a
    /// CA, one without permitted dNSName constraints (it could vouch for any name), a key that
    /// is not the certificate's.
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<InterceptCa, CaError> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| CaError::Io {
                path: path.to_owned(),
                source,
            })
        };
        let unusable = |path: &Path, why: String| CaError::Unusable {
            path: path.to_owned(),
            why,
        };
        let cert_pem = read(cert_path)?;
        let key = KeyPair::from_pem(&read(key_path)?)
            .map_err(|e| unusable(key_path, format!("not a private key ({e})")))?;
        let der = {
            use rustls::pki_types::pem::PemObject;
            rustls::pki_types::CertificateDer::from_pem_slice(cert_pem.as_bytes())
                .map_err(|e| unusable(cert_path, format!("no certificate ({e})")))?
        };
        let (_, parsed) = x509_parser::parse_x509_certificate(&der)
            .map_err(|e| unusable(cert_path, format!("not a certificate ({e})")))?;
        if parsed.tbs_certificate.subject_pki.raw != key.public_key_der().as_slice() {
            return Err(unusable(
                key_path,
                format!("not the key of {}", cert_path.display()),
            ));
        }
        let params = CertificateParams::from_ca_cert_der(&der)
            .map_err(|e| unusable(cert_path, format!("not a CA certificate ({e})")))?;
        if !matches!(params.is_ca, IsCa::Ca(_)) {
            return Err(unusable(cert_path, "not a CA certificate".into()));
        }
        let subtrees: Vec<String> = params
            .name_constraints
            .iter()
            .flat_map(|c| &c.permitted_subtrees)
            .filter_map(|s| match s {
                GeneralSubtree::DnsName(name) => Some(name.to_ascii_lowercase()),
                _ => None,
            })
            .collect();
        if subtrees.is_empty() {
            return Err(unusable(
                cert_path,
                "no permitted DNS name constraints: a CA that could vouch for any name is never used (make one with `leasegate ca init`)".into(),
            ));
        }
        let not_after = params.not_after;
        let issuer = params.self_signed(&key)?;
        Ok(InterceptCa {
            der,
            issuer,
            key,
            subtrees,
            not_after,
        })
    }

    /// The certificate, DER (the trust anchor clients are given).
    pub fn cert_der(&self) -> &rustls::pki_types::CertificateDer<'static> {
        &self.der
    }

    /// The permitted dNSName subtrees.
    pub fn subtrees(&self) -> &[String] {
        &self.subtrees
    }

    /// The normalised DNS name `name` is, when the CA's constraints permit it: the name of a
    /// subtree or one of its subdomains. IP literals and malformed names never are.
    pub fn permits(&self, name: &str) -> Option<String> {
        let TargetHost::Name(name) =
            crate::policy::target::parse_host(&name.to_ascii_lowercase()).ok()?
        else {
            return None;
        };
        self.subtrees
            .iter()
            .any(|s| {
                name == *s
                    || name
                        .strip_suffix(s.as_str())
                        .is_some_and(|rest| rest.ends_with('.'))
            })
            .then_some(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(patterns: &[&str]) -> Vec<String> {
        patterns.iter().map(|p| p.to_string()).collect()
    }

    #[test]
    fn patterns_become_dns_subtrees() {
        let subtrees = permitted_subtrees(&strings(&[
            "*.Example.test",
            "api.other.test",
            "*.example.test",
        ]));
        assert_eq!(subtrees.unwrap(), ["example.test", "api.other.test"]);
    }

    #[test]
    fn everything_addresses_and_malformed_patterns_are_refused() {
        for (pattern, says) in [
            ("*", "every name"),
            ("10.0.0.1", "IP address"),
            ("https://x.test", "no scheme"),
            ("*x.test", "wildcard"),
        ] {
            let refused = permitted_subtrees(&strings(&[pattern])).unwrap_err();
            assert!(refused.to_string().contains(says), "{pattern}: {refused}");
        }
        assert!(matches!(permitted_subtrees(&[]), Err(CaError::NoPatterns)));
        for validity in [
            Duration::ZERO,
            MAX_VALIDITY + Duration::from_secs(1),
            Duration::MAX,
        ] {
            let refused = make(&strings(&["origin.test"]), validity).unwrap_err();
            assert!(
                matches!(refused, CaError::Validity),
                "{validity:?}: {refused}"
            );
        }
    }

    #[test]
    fn write_creates_the_key_0600_and_refuses_to_overwrite() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let made = make(&strings(&["origin.test"]), Duration::from_secs(3600)).unwrap();
        let (cert, key) = write(&made, dir.path(), false).unwrap();
        assert_eq!(key.metadata().unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_to_string(&cert).unwrap(), made.cert_pem);
        let again = make(&strings(&["origin.test"]), Duration::from_secs(3600)).unwrap();
        assert!(matches!(
            write(&again, dir.path(), false),
            Err(CaError::Exists(_))
        ));
        assert_eq!(std::fs::read_to_string(&cert).unwrap(), made.cert_pem);
        write(&again, dir.path(), true).unwrap();
        assert_eq!(std::fs::read_to_string(&cert).unwrap(), again.cert_pem);
        assert_eq!(key.metadata().unwrap().permissions().mode() & 0o777, 0o600);
        assert!(!format!("{again:?}").contains("PRIVATE"));
    }

    #[test]
    fn load_refuses_an_unconstrained_ca_and_a_key_not_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let open = params.self_signed(&key).unwrap();
        let (cert_path, key_path) = (dir.path().join("open.pem"), dir.path().join("open-key.pem"));
        std::fs::write(&cert_path, open.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        let refused = InterceptCa::load(&cert_path, &key_path).unwrap_err();
        assert!(
            refused
                .to_string()
                .contains("no permitted DNS name constraints"),
            "{refused}"
        );

        let made = make(&strings(&["origin.test"]), Duration::from_secs(3600)).unwrap();
        std::fs::write(&cert_path, &made.cert_pem).unwrap();
        let refused = InterceptCa::load(&cert_path, &key_path).unwrap_err();
        assert!(refused.to_string().contains("not the key of"), "{refused}");
        std::fs::write(&key_path, &made.key_pem).unwrap();
        let ca = InterceptCa::load(&cert_path, &key_path).unwrap();
        assert_eq!(ca.subtrees(), ["origin.test"]);
        assert!(!format!("{ca:?}").contains("PRIVATE"));
    }
}
