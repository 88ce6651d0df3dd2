// SPDX-License-Identifier: MPL-2.0
//! Producer and consumer in separate containers: each runs in its own PID, IPC, mount and
//! network namespaces (unshare(1)), with a /dev/shm of its own, and they find each other only
//! through the directory that holds the stream's socket (bind-mounted at /mnt in both,
//! GPUSHM_RUNTIME_DIR=/mnt). The ring travels as a descriptor over the socket, so no
//! --ipc=host and no shared /dev/shm are needed. (The rest of the file system stays visible:
//! the test's own binaries may live anywhere, /tmp included, as they do in CI.) Needs root
//! (unshare); skip with --skip as_root.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

/// `cmd` run inside new namespaces and a /dev/shm of its own, with `shared` at /mnt and
/// GPUSHM_RUNTIME_DIR=/mnt.
fn contained(shared: &Path, cmd: &Command) -> Command {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test makes namespaces with unshare and needs root; skip it with --skip as_root"
    );
    let mut argv = vec![cmd.get_program().to_string_lossy().into_owned()];
    argv.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    let quoted: Vec<String> = argv
        .iter()
        .map(|a| format!("'{}'", a.replace('\'', "'\\''")))
        .collect();
    let script = format!(
        "set -e; mount --make-rprivate /; mount -t tmpfs none /dev/shm; \
         mount --bind '{}' /mnt; \
         echo NS pid=$$ ipc=$(readlink /proc/self/ns/ipc) net=$(readlink /proc/self/ns/net) shm=$(ls -A /dev/shm | wc -l); \
         export GPUSHM_RUNTIME_DIR=/mnt; exec {}",
        shared.display(),
        quoted.join(" ")
    );
    let mut c = Command::new("unshare");
    c.args([
        "--pid",
        "--fork",
        "--ipc",
        "--mount",
        "--net",
        "--uts",
        "--mount-proc",
        "sh",
        "-c",
        &script,
    ]);
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    c
}

#[test]
fn as_root_producer_and_consumer_in_separate_namespaces_share_only_the_socket_directory() {
    let shared = tmpdir();
    let mut p = example("pattern_producer");
    p.args([
        "--stream", "cam", "--format", "I420", "--width", "320", "--height", "240",
    ])
    .args(["--frames", "30", "--fps", "30", "--wait"]);
    let producer = Proc::spawn(contained(shared.path(), &p), "contained producer");
    wait_for_path(&shared.path().join("cam"), Duration::from_secs(10));
    let mut c = example("frame_checker");
    c.args([
        "--stream",
        "cam",
        "--verify",
        "--lossless",
        "--expect",
        "30",
        "--no-reconnect",
    ]);
    let (status, out) = Proc::spawn(contained(shared.path(), &c), "contained consumer")
        .finish(Duration::from_secs(60));
    assert!(status.success(), "{}", out.join("\n"));
    assert!(
        out.iter().any(|l| l.starts_with("SUMMARY frames=30 bad=0")),
        "{}",
        out.join("\n")
    );
    // Its own namespaces: pid 1, and not this process's IPC or network namespace.
    let ns = out.iter().find(|l| l.starts_with("NS ")).expect("NS line");
    assert!(ns.contains("pid=1 "), "{ns}");
    let mine = |k: &str| std::fs::read_link(format!("/proc/self/ns/{k}")).unwrap();
    assert!(
        !ns.contains(&mine("ipc").to_string_lossy().to_string()),
        "{ns}"
    );
    assert!(
        !ns.contains(&mine("net").to_string_lossy().to_string()),
        "{ns}"
    );
    assert!(ns.ends_with("shm=0"), "a /dev/shm of its own: {ns}");
    let (status, pout) = producer.finish(Duration::from_secs(30));
    assert!(status.success(), "{}", pout.join("\n"));
    let pns = pout
        .iter()
        .find(|l| l.starts_with("NS "))
        .expect("producer NS line");
    assert_ne!(
        pns.split(' ').nth(2),
        ns.split(' ').nth(2),
        "separate IPC namespaces"
    );
}
