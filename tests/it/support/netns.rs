//! A test that needs a host shape this machine may lack (a non-loopback address) runs again in
//! a network namespace of its own that has it; the host's namespace is never changed.

use super::{has_command, is_root, skip};

/// The address the namespace of [`rerun_with_own_address`] gives its loopback interface: not a
/// loopback address, and inside the 10.203.0.0/16 range `tests/netns/` keeps to.
pub const OWN_ADDRESS: &str = "10.203.9.1";

/// Set in the run inside the namespace, so that a test that still finds nothing fails there
/// instead of starting a namespace again.
const INSIDE: &str = "LEASEGATE_TEST_NETNS";

/// Runs the calling test again, alone (this test binary, `--exact`), in a new network namespace
/// whose loopback interface is up and also holds [`OWN_ADDRESS`], and asserts that it passed
/// there. Needs root (CI runs as root), `unshare` (util-linux) and `ip` (iproute2); without
/// them, [`skip`].
pub async fn rerun_with_own_address() {
    let thread = std::thread::current();
    let test = thread
        .name()
        .expect("libtest names a test's thread after the test")
        .to_owned();
    assert!(
        std::env::var_os(INSIDE).is_none(),
        "{test}: no non-loopback address even in a namespace holding {OWN_ADDRESS}"
    );
    if !is_root() {
        return skip("no non-loopback address here, and a network namespace with one needs root");
    }
    if !has_command("unshare") || !has_command("ip") {
        return skip(
            "no non-loopback address here, and a network namespace with one needs unshare and ip \
             (apt-get install util-linux iproute2)",
        );
    }
    let setup =
        format!("ip link set lo up && ip addr add {OWN_ADDRESS}/32 dev lo && exec \"$0\" \"$@\"");
    let out = tokio::process::Command::new("unshare")
        .args(["--net", "sh", "-c", &setup])
        .arg(std::env::current_exe().unwrap())
        .args([test.as_str(), "--exact", "--nocapture"])
        .env(INSIDE, "1")
        .output()
        .await
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{test} in a network namespace holding {OWN_ADDRESS} ({}): {text}",
        out.status
    );
}
