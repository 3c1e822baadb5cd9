//! What `run`'s child gets for brokered credentials: each placeholder in its variable, and the
//! interception CA in the files and variables TLS clients read.
//!
//! Invariant: nothing here ever holds a secret's value (the admin API hands out placeholders
//! only). A variable named by the answer is set only when it is a variable name that `run`
//! does not set itself, no proxy setting, and not one that changes what the child runs or
//! loads (`PATH`, `LD_*`, ...), so the answer can neither move the child off the proxy nor
//! replace its trust settings. The CA files live in a new private directory (0700) that is
//! removed when `run` ends; Java, which reads no PEM variable, gets a trust store there of the
//! same certificates as the bundle, named in `JAVA_TOOL_OPTIONS` after what it held.

use super::jks;
use super::RunError;
use rustls::pki_types::{pem::PemObject, CertificateDer};
use serde_json::Value;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The system bundles a CA is appended to, the first readable one: Debian and its kin, the
/// Red Hat family, then Alpine, macOS and the BSDs.
pub const SYSTEM_BUNDLES: [&str; 3] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];

use crate::intercept::ca::{BUNDLE_VARS, CA_VAR};

/// The variable the JVM reads options from, whatever launches it (`java`, Gradle, Maven).
pub const JAVA_VAR: &str = "JAVA_TOOL_OPTIONS";

/// The Java trust store's password. Not a secret: the store holds public certificates only,
/// and the password guards its integrity; the JDK's own `cacerts` uses the same one.
const JAVA_STORE_PASSWORD: &str = "changeit";

/// Names a placeholder never goes in, whatever the answer says (upper-cased): what `run`
/// sets itself and what changes what the child runs or loads.
const NEVER: [&str; 13] = [
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "GIT_SSL_CAINFO",
    "NODE_EXTRA_CA_CERTS",
    "NODE_USE_ENV_PROXY",
    "NODE_OPTIONS",
    "JAVA_TOOL_OPTIONS",
    "PATH",
    "HOME",
    "SHELL",
    "IFS",
];

/// The lease's placeholders (variable, placeholder) and the interception CA (PEM), as read
/// from `GET /leases/{id}/placeholders`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Brokered {
    pub placeholders: Vec<(String, String)>,
    pub ca: Option<String>,
    /// The variables named that a placeholder may not go in: left out, for a warning.
    pub refused: Vec<String>,
}

impl Brokered {
    /// Reads the admin API's answer; anything not in the documented form is an error that
    /// says what (`admin`: the admin URL, for the message).
    pub fn parse(answer: &Value, admin: &str) -> Result<Brokered, RunError> {
        let unreadable = |what: String| RunError::Admin {
            url: admin.to_owned(),
            status: http::StatusCode::OK,
            message: format!("unreadable placeholders: {what}"),
        };
        let list = answer["placeholders"]
            .as_array()
            .ok_or_else(|| unreadable("no \"placeholders\" list".into()))?;
        let mut placeholders = Vec::with_capacity(list.len());
        let mut refused = Vec::new();
        for entry in list {
            let (Some(env), Some(placeholder)) =
                (entry["env"].as_str(), entry["placeholder"].as_str())
            else {
                return Err(unreadable(format!("entry {entry}")));
            };
            if !is_placeholder(placeholder) {
                return Err(unreadable(format!("{env}: not a placeholder")));
            }
            // Left out rather than fatal: the child is only without that placeholder.
            match settable(env) {
                true => placeholders.push((env.to_owned(), placeholder.to_owned())),
                false => refused.push(env.to_owned()),
            }
        }
        let ca = match &answer["ca"] {
            Value::Null => None,
            Value::String(pem) => {
                let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| unreadable(format!("ca: {e}")))?;
                if certs.len() != 1 {
                    return Err(unreadable(format!(
                        "ca: {} certificates, not one",
                        certs.len()
                    )));
                }
                x509_parser::parse_x509_certificate(&certs[0])
                    .map_err(|e| unreadable(format!("ca: {e}")))?;
                Some(pem.clone())
            }
            other => return Err(unreadable(format!("ca {other}"))),
        };
        Ok(Brokered {
            placeholders,
            ca,
            refused,
        })
    }
}

/// Whether a placeholder may be put in the variable `name`: a portable name (letters, digits,
/// `_`, not starting with a digit) that is no proxy setting, not `LEASEGATE_*`, `LD_*` or
/// `DYLD_*`, nor one of [`NEVER`].
fn settable(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    let portable = name
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    portable
        && !super::is_proxy_setting(name.as_ref())
        && !["LEASEGATE_", "LD_", "DYLD_"]
            .iter()
            .any(|p| upper.starts_with(p))
        && !NEVER.contains(&upper.as_str())
}

/// Whether `text` has a placeholder's form (so nothing else is handed to the child as one).
fn is_placeholder(text: &str) -> bool {
    crate::secrets::placeholder::secret_id_of(text).is_some()
}

/// The CA's files for the child, in a private directory removed on drop.
pub struct TrustFiles {
    dir: tempfile::TempDir,
}

impl TrustFiles {
    /// Writes `ca.pem` (the CA alone) and `bundle.pem` (the first readable of `bundles`,
    /// then the CA) into a new directory, mode 0700. Without a readable bundle, `bundle.pem`
    /// holds the CA alone and the second value says so, for a warning.
    pub fn write(ca: &str, bundles: &[&str]) -> Result<(TrustFiles, Option<String>), RunError> {
        let failed = |path: &Path, e: std::io::Error| RunError::TrustFiles {
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        // Made 0700 (not narrowed after): the child's user alone reads it.
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::Builder::new()
            .prefix("leasegate-run-")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()
            .map_err(|e| failed(&std::env::temp_dir(), e))?;
        let files = TrustFiles { dir };
        let system = bundles
            .iter()
            .find_map(|path| std::fs::read(path).ok().filter(|b| !b.is_empty()));
        let warning = system.is_none().then(|| {
            format!(
                "no system CA bundle is readable ({}): {} holds the interception CA alone, so \
                 clients that read it trust no other CA",
                bundles.join(", "),
                files.bundle().display()
            )
        });
        let mut bundle = system.unwrap_or_default();
        if !bundle.is_empty() && !bundle.ends_with(b"\n") {
            bundle.push(b'\n');
        }
        let store = java_store(&bundle, ca).map_err(|reason| RunError::TrustFiles {
            path: files.java_store().display().to_string(),
            reason,
        })?;
        bundle.extend_from_slice(ca.as_bytes());
        let ca_path = files.ca();
        std::fs::write(&ca_path, ca).map_err(|e| failed(&ca_path, e))?;
        let bundle_path = files.bundle();
        std::fs::write(&bundle_path, bundle).map_err(|e| failed(&bundle_path, e))?;
        let store_path = files.java_store();
        std::fs::write(&store_path, store).map_err(|e| failed(&store_path, e))?;
        Ok((files, warning))
    }

    /// `ca.pem`: the interception CA alone.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// `bundle.pem`: the system's roots, then the interception CA.
    pub fn bundle(&self) -> PathBuf {
        self.dir.path().join("bundle.pem")
    }

    /// `truststore.jks`: the bundle's certificates, for Java.
    pub fn java_store(&self) -> PathBuf {
        self.dir.path().join("truststore.jks")
    }

    /// `JAVA_TOOL_OPTIONS` for the child: what it held (`inherited`), then the options naming
    /// [`TrustFiles::java_store`] (the JVM takes the last of a repeated `-D`, so ours win).
    /// The JVM splits the variable at white space, so a directory whose path holds white
    /// space or quotes cannot be named there: that is an error, for a warning, and Java is
    /// left trusting its own roots (so a terminated host fails its handshake, closed).
    pub fn java_tool_options(&self, inherited: Option<OsString>) -> Result<OsString, String> {
        let path = self.java_store();
        let plain = |c: char| !(c.is_whitespace() || c == '"' || c == '\'' || c.is_control());
        let Some(store) = path.to_str().filter(|p| p.chars().all(plain)) else {
            return Err(format!(
                "{JAVA_VAR} cannot name {} (white space, quotes or bytes not UTF-8 in its \
                 path): Java programs will not trust the interception CA; set TMPDIR to a \
                 plain path",
                path.display()
            ));
        };
        let ours = format!(
            "-Djavax.net.ssl.trustStore={store} -Djavax.net.ssl.trustStoreType=JKS \
             -Djavax.net.ssl.trustStorePassword={JAVA_STORE_PASSWORD}"
        );
        let mut options = inherited
            .filter(|held| !held.is_empty())
            .unwrap_or_default();
        if !options.is_empty() {
            options.push(" ");
        }
        options.push(ours);
        Ok(options)
    }

    /// The variables that point TLS clients at these files.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let bundle = self.bundle().display().to_string();
        let mut set: Vec<(&'static str, String)> =
            BUNDLE_VARS.iter().map(|v| (*v, bundle.clone())).collect();
        set.push((CA_VAR, self.ca().display().to_string()));
        set
    }
}

/// The Java trust store of `system` (a PEM bundle: its certificates, up to the first that
/// cannot be read) and `ca` (the interception CA, always last).
fn java_store(system: &[u8], ca: &str) -> Result<Vec<u8>, String> {
    // A bundle may hold text or a damaged block; the JVM refuses a whole store over one
    // certificate it cannot read, so only what parses as X.509 goes in.
    let roots: Vec<CertificateDer> = CertificateDer::pem_slice_iter(system)
        .map_while(Result::ok)
        .filter(|der| x509_parser::parse_x509_certificate(der).is_ok())
        .collect();
    let ca = CertificateDer::from_pem_slice(ca.as_bytes()).map_err(|e| format!("ca: {e}"))?;
    let mut entries: Vec<jks::Entry> = roots
        .iter()
        .enumerate()
        .map(|(n, der)| jks::Entry {
            alias: format!("system-{n}"),
            der,
        })
        .collect();
    entries.push(jks::Entry {
        alias: "leasegate-ca".to_owned(),
        der: &ca,
    });
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    jks::trust_store(&entries, JAVA_STORE_PASSWORD, now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CA: &str = "-----BEGIN CERTIFICATE-----\nMIIBJTCBzKADAgECAgEBMAoGCCqGSM49BAMCMAAwHhcNMjUwMTAxMDAwMDAwWhcNMzUwMTAxMDAwMDAwWjAAMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE\n-----END CERTIFICATE-----\n";

    fn ca() -> String {
        let made = crate::intercept::ca::make(
            &["origin.test".to_owned()],
            std::time::Duration::from_secs(60),
        )
        .unwrap();
        made.cert_pem
    }

    #[test]
    fn an_answer_is_read_whole_or_refused() {
        let placeholder = "lgp_github_abcdefghijklmnopqrstuvwxyz";
        let ca = ca();
        let good = json!({"lease": "l", "ca": ca,
            "placeholders": [{"secret": "github", "env": "GITHUB_TOKEN", "placeholder": placeholder}]});
        assert_eq!(
            Brokered::parse(&good, "http://a").unwrap(),
            Brokered {
                placeholders: vec![("GITHUB_TOKEN".into(), placeholder.into())],
                ca: Some(ca.clone()),
                refused: Vec::new(),
            }
        );
        let none = json!({"lease": "l", "placeholders": [], "ca": null});
        assert_eq!(
            Brokered::parse(&none, "http://a").unwrap(),
            Brokered::default()
        );
        for env in [
            "HTTPS_PROXY",
            "no_proxy",
            "SSL_CERT_FILE",
            "Path",
            "LD_PRELOAD",
            "LEASEGATE_LEASE_ID",
            "JAVA_TOOL_OPTIONS",
            "1X",
            "A=B",
            "",
        ] {
            let bad = json!({"placeholders": [
                {"env": env, "placeholder": placeholder},
                {"env": "SEARCH_KEY", "placeholder": placeholder},
            ], "ca": null});
            let read = Brokered::parse(&bad, "http://a").unwrap();
            assert_eq!(read.refused, [env], "{env:?}");
            assert_eq!(
                read.placeholders,
                [("SEARCH_KEY".to_owned(), placeholder.to_owned())]
            );
        }
        for bad in [
            json!({"placeholders": [{"env": "GITHUB_TOKEN", "placeholder": "ghp_real"}], "ca": null}),
            json!({"lease_id": "l", "status": "open"}),
            json!({"placeholders": [], "ca": "not a certificate"}),
            json!({"placeholders": [], "ca": format!("{ca}{ca}")}),
            json!({"placeholders": [], "ca": CA}),
            json!({"placeholders": [], "ca": 1}),
        ] {
            assert!(
                matches!(
                    Brokered::parse(&bad, "http://a"),
                    Err(RunError::Admin { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_files_are_private_and_go_with_their_owner() {
        use std::os::unix::fs::PermissionsExt;
        let ca = ca();
        let dir = tempfile::tempdir().unwrap();
        let system = dir.path().join("system.crt");
        std::fs::write(&system, "SYSTEM ROOTS").unwrap();
        let missing = dir.path().join("missing.crt");
        let bundles = [missing.to_str().unwrap(), system.to_str().unwrap()];
        let (files, warning) = TrustFiles::write(&ca, &bundles).unwrap();
        assert_eq!(warning, None);
        let home = files.ca().parent().unwrap().to_owned();
        assert_eq!(home.metadata().unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(std::fs::read_to_string(files.ca()).unwrap(), ca);
        assert_eq!(
            std::fs::read_to_string(files.bundle()).unwrap(),
            format!("SYSTEM ROOTS\n{ca}")
        );
        let env = files.env();
        assert_eq!(env.len(), 5);
        assert!(env.contains(&("SSL_CERT_FILE", files.bundle().display().to_string())));
        assert!(env.contains(&("NODE_EXTRA_CA_CERTS", files.ca().display().to_string())));
        drop(files);
        assert!(!home.exists());

        let (files, warning) = TrustFiles::write(&ca, &[missing.to_str().unwrap()]).unwrap();
        assert!(warning.unwrap().contains("no system CA bundle"));
        assert_eq!(std::fs::read_to_string(files.bundle()).unwrap(), ca);
        let store = std::fs::read(files.java_store()).unwrap();
        let listed = jks::read_back(&store, JAVA_STORE_PASSWORD);
        assert_eq!(listed.len(), 1, "the CA alone");
    }

    /// Java's store lists every root of the system bundle (text and a damaged block in it
    /// skipped), then the CA; `JAVA_TOOL_OPTIONS` names it after what the variable held.
    #[test]
    fn the_java_store_lists_the_bundle_and_the_ca() {
        let (ca, roots) = (ca(), [ca(), ca()]);
        let dir = tempfile::tempdir().unwrap();
        let system = dir.path().join("system.crt");
        std::fs::write(
            &system,
            format!(
                "# Roots\n{}\n{}-----BEGIN CERTIFICATE-----\nAAAA\n",
                roots[0], roots[1]
            ),
        )
        .unwrap();
        let (files, _) = TrustFiles::write(&ca, &[system.to_str().unwrap()]).unwrap();
        let store = std::fs::read(files.java_store()).unwrap();
        let listed: Vec<(String, Vec<u8>)> = jks::read_back(&store, JAVA_STORE_PASSWORD)
            .into_iter()
            .map(|(alias, _, der)| (alias, der))
            .collect();
        let der = |pem: &str| {
            CertificateDer::from_pem_slice(pem.as_bytes())
                .unwrap()
                .to_vec()
        };
        assert_eq!(
            listed,
            [
                ("system-0".to_owned(), der(&roots[0])),
                ("system-1".to_owned(), der(&roots[1])),
                ("leasegate-ca".to_owned(), der(&ca)),
            ]
        );

        let path = files.java_store().display().to_string();
        let ours = format!(
            "-Djavax.net.ssl.trustStore={path} -Djavax.net.ssl.trustStoreType=JKS \
             -Djavax.net.ssl.trustStorePassword=changeit"
        );
        assert_eq!(files.java_tool_options(None).unwrap(), ours.as_str());
        assert_eq!(
            files.java_tool_options(Some("".into())).unwrap(),
            ours.as_str()
        );
        assert_eq!(
            files
                .java_tool_options(Some("-Xmx1g -Dhttps.proxyHost=h".into()))
                .unwrap(),
            format!("-Xmx1g -Dhttps.proxyHost=h {ours}").as_str()
        );
        use std::os::unix::ffi::OsStringExt;
        let held = OsString::from_vec(b"-Dodd=\xff".to_vec());
        let mut kept = held.clone().into_vec();
        kept.extend_from_slice(format!(" {ours}").as_bytes());
        assert_eq!(
            files.java_tool_options(Some(held)).unwrap().into_vec(),
            kept
        );
    }
}
