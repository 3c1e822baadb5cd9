//! `compare-harness cpu --pids NAME=PID[,NAME=PID...]`: the CPU time each named process has
//! used so far, its descendants' included (Squid's workers are children of its master), as one
//! JSON object: `{"clk_tck": 100, "NAME": {"user_s": .., "system_s": .., "cpu_s": ..,
//! "pids": [..]}, ...}`. run.sh reads it before and after every load run.
//!
//! Invariant: `user_s` and `system_s` are utime and stime of /proc/PID/stat (all its threads,
//! ended ones included), which count in clock ticks (10 ms); `cpu_s` is the sum of its live
//! threads' /proc/PID/task/TID/schedstat run time, in nanoseconds, for figures a few ticks
//! long (a 100 MiB download through a tunnel takes well under 10 ticks of the proxy's CPU).
//! A named process that is gone is an error, never a zero.

use crate::{Opts, Result};
use serde_json::{json, Map, Value};
use std::collections::HashMap;

/// One process's line of /proc/PID/stat, the fields used.
#[derive(Debug, PartialEq)]
struct Stat {
    ppid: u32,
    utime: u64,
    stime: u64,
}

/// Parses a /proc/PID/stat line. The command name (field 2) is in parentheses and may hold
/// spaces and parentheses itself, so the fields are counted from the last `)`.
fn parse_stat(line: &str) -> Option<Stat> {
    let rest = &line[line.rfind(')')? + 1..];
    // After the name: state (field 3), ppid (4), ..., utime (14), stime (15).
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(Stat {
        ppid: fields.get(1)?.parse().ok()?,
        utime: fields.get(11)?.parse().ok()?,
        stime: fields.get(12)?.parse().ok()?,
    })
}

/// The run time of `pid`'s live threads, from the first field of each one's schedstat (ns).
fn runtime_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(|task| {
            let path = task.ok()?.path().join("schedstat");
            std::fs::read_to_string(path)
                .ok()?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

fn read_stat(pid: u32) -> Option<Stat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Every process now running, by pid.
fn all_processes() -> HashMap<u32, Stat> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return HashMap::new();
    };
    dir.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, read_stat(pid)?)))
        .collect()
}

/// `root` and its descendants among `procs`, `root` first.
fn tree(root: u32, procs: &HashMap<u32, Stat>) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for (&pid, stat) in procs {
        children.entry(stat.ppid).or_default().push(pid);
    }
    let mut out = vec![root];
    let mut at = 0;
    while at < out.len() {
        if let Some(kids) = children.get(&out[at]) {
            out.extend(kids.iter().copied().filter(|k| *k != root));
        }
        at += 1;
    }
    out
}

/// `NAME=PID[,NAME=PID...]`.
fn parse_pids(list: &str) -> Result<Vec<(String, u32)>> {
    let pairs: Vec<(String, u32)> = list
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (name, pid) = pair
                .split_once('=')
                .ok_or_else(|| format!("--pids {pair:?}: expected NAME=PID"))?;
            let pid = pid
                .parse()
                .map_err(|_| format!("--pids {pair:?}: {pid:?} is not a pid"))?;
            Ok::<_, crate::Error>((name.to_owned(), pid))
        })
        .collect::<Result<_>>()?;
    if pairs.is_empty() {
        return Err("--pids: at least one NAME=PID".into());
    }
    Ok(pairs)
}

pub fn cpu(opts: &Opts) -> Result<()> {
    let out = measure(&parse_pids(opts.req("pids")?)?)?;
    println!("{out}");
    Ok(())
}

fn measure(pids: &[(String, u32)]) -> Result<Value> {
    // SAFETY: sysconf has no preconditions.
    let tck = match unsafe { libc::sysconf(libc::_SC_CLK_TCK) } {
        n if n > 0 => n as f64,
        _ => return Err("sysconf(_SC_CLK_TCK) failed".into()),
    };
    let procs = all_processes();
    let mut out = Map::new();
    out.insert("clk_tck".into(), json!(tck));
    for (name, pid) in pids {
        if !procs.contains_key(pid) {
            return Err(format!("{name}: no process {pid}").into());
        }
        let members = tree(*pid, &procs);
        let (user, system) = members
            .iter()
            .filter_map(|p| procs.get(p))
            .fold((0, 0), |(u, s), st| (u + st.utime, s + st.stime));
        let runtime: u64 = members.iter().map(|&p| runtime_ns(p)).sum();
        out.insert(
            name.clone(),
            json!({"user_s": user as f64 / tck, "system_s": system as f64 / tck,
                   "cpu_s": runtime as f64 / 1e9, "pids": members}),
        );
    }
    Ok(Value::Object(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_is_read_past_a_name_with_spaces_and_parentheses() {
        let line = "4242 (squid (worker) 1) S 17 4242 4242 0 -1 4194560 1057 0 0 0 \
                    345 678 0 0 20 0 1 0 123 4567 89 18446744073709551615";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                ppid: 17,
                utime: 345,
                stime: 678
            })
        );
        assert_eq!(parse_stat("4242 (cut) S 1 2"), None, "too few fields");
        assert_eq!(parse_stat("no parenthesis"), None);
    }

    #[test]
    fn a_tree_holds_the_root_and_every_descendant_once() {
        let procs: HashMap<u32, Stat> = [(1, 0), (10, 1), (11, 10), (12, 10), (13, 11), (20, 1)]
            .into_iter()
            .map(|(pid, ppid)| {
                (
                    pid,
                    Stat {
                        ppid,
                        utime: 0,
                        stime: 0,
                    },
                )
            })
            .collect();
        let mut got = tree(10, &procs);
        assert_eq!(got[0], 10);
        got.sort();
        assert_eq!(got, vec![10, 11, 12, 13]);
    }

    /// The nanosecond run time follows the ticks: a thread that runs 300 ms adds at least that
    /// much to it, and it never runs ahead of the ticks.
    #[test]
    fn the_run_time_is_counted_in_nanoseconds_and_agrees_with_the_ticks() {
        let me = [("me".to_string(), std::process::id())];
        let before = measure(&me).unwrap();
        let (done, finished) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let spinner = std::thread::spawn(move || {
            // Spins until it has run 300 ms by its own count, whatever else shares the cores.
            let own = || -> u64 {
                let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
                s.split_whitespace().next().unwrap().parse().unwrap()
            };
            let start = own();
            while own() - start < 300_000_000 {
                std::hint::black_box(0u64);
            }
            done.send(()).unwrap();
            // Alive past the second reading: its run time must still be there.
            let _ = released.recv();
        });
        finished.recv().unwrap();
        let after = measure(&me).unwrap();
        release.send(()).unwrap();
        spinner.join().unwrap();
        let d = |k: &str| after["me"][k].as_f64().unwrap() - before["me"][k].as_f64().unwrap();
        let ticks = d("user_s") + d("system_s");
        assert!(d("cpu_s") >= 0.25, "cpu_s {}", d("cpu_s"));
        // Threads of other tests that ended meanwhile leave the ticks only, never cpu_s; the
        // ticks are each rounded down to 10 ms.
        assert!(
            d("cpu_s") <= ticks + 0.05,
            "cpu_s {} vs ticks {ticks}",
            d("cpu_s")
        );
    }

    /// A child's CPU counts in its parent's figure, and a process that is gone is an error.
    #[test]
    fn a_child_counts_and_a_missing_process_fails() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep(1)");
        let me = std::process::id();
        let out = measure(&[("me".into(), me)]).unwrap();
        let pids: Vec<u64> = out["me"]["pids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_u64().unwrap())
            .collect();
        assert_eq!(pids[0], me as u64);
        assert!(pids.contains(&(child.id() as u64)), "{pids:?}");
        assert!(out["me"]["user_s"].as_f64().unwrap() >= 0.0);
        child.kill().unwrap();
        child.wait().unwrap();
        let gone = child.id();
        let err = measure(&[("gone".into(), gone)]).unwrap_err().to_string();
        assert_eq!(err, format!("gone: no process {gone}"));
        assert!(parse_pids("proxy").is_err());
        assert!(parse_pids("").is_err());
        assert_eq!(
            parse_pids("proxy=12,origin=34").unwrap(),
            vec![("proxy".to_string(), 12), ("origin".to_string(), 34)]
        );
    }
}
