//! A test that needs a host shape this machine may lack (a non-loopback address, or no way
//! out but loopback) runs again in a network namespace of its own that has it; the host's
//! namespace is never changed.

use super::{has_command, is_root, skip};

/// The address the namespace of [`rerun_with_own_address`] gives its loopback interface: not a
/// loopback address, and inside the 10.203.0.0/16 range `tests/netns/` keeps to.
pub const OWN_ADDRESS: &str = "10.203.9.1";

/// Set in the run inside the namespace to the namespace's shape, so that a test that still
/// finds nothing fails there instead of starting a namespace again.
const INSIDE: &str = "LEASEGATE_TEST_NETNS";

/// The shape of [`in_loopback_only_namespace`]'s namespace, as [`INSIDE`] says it.
const LOOPBACK_ONLY: &str = "loopback-only";

/// Runs the calling test again, alone (this test binary, `--exact`), in a new network namespace
/// whose loopback interface is up and also holds [`OWN_ADDRESS`], and asserts that it passed
/// there. Needs root (CI runs as root), `unshare` (util-linux) and `ip` (iproute2); without
/// them, [`skip`].
pub async fn rerun_with_own_address() {
    let test = current_test();
    assert!(
        std::env::var_os(INSIDE).is_none(),
        "{test}: no non-loopback address even in a namespace holding {OWN_ADDRESS}"
    );
    rerun(
        &format!("ip link set lo up && ip addr add {OWN_ADDRESS}/32 dev lo"),
        "own-address",
        &format!("no non-loopback address here, and a network namespace holding {OWN_ADDRESS}"),
    )
    .await;
}

/// Whether the calling test runs in a network namespace whose only interface is loopback, so
/// that a client that ignores its proxy settings cannot reach out and fails instead. Outside
/// one, runs the test again in one (alone, as [`rerun_with_own_address`] does), asserts that it
/// passed there and returns false: the caller returns. Needs what that needs, else [`skip`].
pub async fn in_loopback_only_namespace() -> bool {
    if std::env::var(INSIDE).is_ok_and(|shape| shape == LOOPBACK_ONLY) {
        let interfaces: Vec<String> = nix::ifaddrs::getifaddrs()
            .unwrap()
            .map(|interface| interface.interface_name)
            .collect();
        assert!(
            interfaces.iter().all(|name| name == "lo"),
            "{}: a loopback-only namespace has {interfaces:?}",
            current_test()
        );
        return true;
    }
    rerun(
        "ip link set lo up",
        LOOPBACK_ONLY,
        "this client test runs in a network namespace with only loopback, which",
    )
    .await;
    false
}

/// The name libtest gives the calling test's thread.
fn current_test() -> String {
    std::thread::current()
        .name()
        .expect("libtest names a test's thread after the test")
        .to_owned()
}

/// Runs the calling test again in a new network namespace that `setup` (a shell command run
/// in it first) shapes, with [`INSIDE`] set to `shape`; `what` names that namespace in a skip.
async fn rerun(setup: &str, shape: &str, what: &str) {
    let test = current_test();
    if !is_root() {
        return skip(&format!("{what} needs root"));
    }
    if !has_command("unshare") || !has_command("ip") {
        return skip(&format!(
            "{what} needs unshare and ip (apt-get install util-linux iproute2)"
        ));
    }
    let setup = format!("{setup} && exec \"$0\" \"$@\"");
    let out = tokio::process::Command::new("unshare")
        .args(["--net", "sh", "-c", &setup])
        .arg(std::env::current_exe().unwrap())
        .args([test.as_str(), "--exact", "--nocapture"])
        .env(INSIDE, shape)
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
        "{test} in a network namespace ({shape}, {}): {text}",
        out.status
    );
}
