//! One memory budget for everything a command sizes from user input (the
//! paged pools of `generate`, `accumulate`, `niah` and `batch`, sized by
//! `--steps`, `--ctx`, `--blocks` and the like): each is checked against
//! the budget before it is allocated, with an error that says what was
//! asked for and what it would take, instead of an allocation that aborts
//! the process or grows until the machine kills it.
//!
//! The budget is 80% of the memory available when the command starts
//! (`MemAvailable` of `/proc/meminfo`, or the room left under the process's
//! cgroup limit where that is less), or what `--memory-limit` sets
//! ([`set_limit`], read by [`limit`]). Where the available memory cannot
//! be read, only an explicit limit applies.

use std::sync::OnceLock;

use crate::error::EvalError;

/// The share of the available memory the default budget allows.
pub const DEFAULT_SHARE: f64 = 0.8;

/// The budget of this process: set once by the command line, or the
/// default on first use.
static LIMIT: OnceLock<Budget> = OnceLock::new();

/// A memory budget and where it came from (for the error message).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Bytes allowed (`u64::MAX`: no limit known).
    pub bytes: u64,
    /// Set by `--memory-limit` rather than by the default share.
    pub explicit: bool,
}

/// Sets the process's budget to `bytes` (`--memory-limit`); `false` if a
/// budget was already in use (it is then left as it was).
pub fn set_limit(bytes: u64) -> bool {
    LIMIT
        .set(Budget {
            bytes,
            explicit: true,
        })
        .is_ok()
}

/// The process's budget: what [`set_limit`] set, or
/// [`DEFAULT_SHARE`] of the memory available now.
pub fn limit() -> Budget {
    *LIMIT.get_or_init(|| Budget {
        bytes: available_bytes().map_or(u64::MAX, |b| (b as f64 * DEFAULT_SHARE) as u64),
        explicit: false,
    })
}

/// The memory this process can still take, in bytes: `MemAvailable` of
/// `/proc/meminfo`, or less where the process's cgroup (v2) caps it
/// (`memory.max` less `memory.current`, a container's limit); `None` where
/// neither can be read (not Linux, or a kernel without the field).
pub fn available_bytes() -> Option<u64> {
    let machine = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| mem_available(&info));
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .zip(std::fs::read_to_string("/sys/fs/cgroup/memory.current").ok())
        .and_then(|(max, current)| cgroup_room(&max, &current));
    match (machine, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
/// This process's resident memory now and at its peak (`VmRSS` and
/// `VmHWM` of `/proc/self/status`), where the system reports them.
pub fn resident_bytes() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    Some((status_kb(&status, "VmRSS:")?, status_kb(&status, "VmHWM:")?))
}

/// The value of a `Key:   N kB` line of a `/proc` status file, in bytes.
fn status_kb(status: &str, key: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..]
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    kb.checked_mul(1024)
}

fn mem_available(info: &str) -> Option<u64> {
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Room left under a cgroup v2 limit (`memory.max`, `memory.current`):
/// `None` for no limit (`max`) or unreadable text.
fn cgroup_room(max: &str, current: &str) -> Option<u64> {
    let max: u64 = max.trim().parse().ok()?;
    let current: u64 = current.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

/// Checks that `bytes` for `what` fit the process's budget.
pub fn check(what: &str, bytes: u64) -> Result<(), EvalError> {
    check_against(limit(), what, bytes)
}

/// Checks that `bytes` for `what` fit `budget`: the error names what was
/// asked for, what it would take and the budget.
pub fn check_against(budget: Budget, what: &str, bytes: u64) -> Result<(), EvalError> {
    if bytes <= budget.bytes {
        return Ok(());
    }
    let origin = if budget.explicit {
        "set by --memory-limit".to_string()
    } else {
        format!(
            "{:.0}% of the memory available at start; --memory-limit changes it",
            DEFAULT_SHARE * 100.0
        )
    };
    Err(EvalError::MemoryBudget {
        what: what.to_string(),
        bytes,
        limit: budget.bytes,
        origin,
    })
}

/// Parses a size: bytes, or a number with a unit `K`, `M`, `G` or `T`
/// (powers of 1024; an optional trailing `B`, any case): `24G`, `512MiB`,
/// `1.5g`, `1000000`.
pub fn parse_size(text: &str) -> Result<u64, EvalError> {
    let bad = |reason: &str| EvalError::InvalidParameter {
        name: "memory-limit",
        reason: format!("{text:?}: {reason} (bytes, or a number with K, M, G or T: 24G, 512M)"),
    };
    let t = text.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix("ib"))
        .or_else(|| t.strip_suffix(['B', 'b']))
        .unwrap_or(t);
    let (number, unit) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&t[..i], c.to_ascii_uppercase()),
        _ => (t, ' '),
    };
    let shift = match unit {
        ' ' => 0,
        'K' => 10,
        'M' => 20,
        'G' => 30,
        'T' => 40,
        _ => return Err(bad("unknown unit")),
    };
    if unit == ' '
        && let Ok(bytes) = number.trim().parse::<u64>()
    {
        // Whole bytes are taken exactly (u64::MAX included).
        return if bytes == 0 {
            Err(bad("must be at least one byte"))
        } else {
            Ok(bytes)
        };
    }
    let value: f64 = number.trim().parse().map_err(|_| bad("not a number"))?;
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < 1.0 || bytes >= u64::MAX as f64 {
        return Err(bad("must be at least one byte and below 16 EiB"));
    }
    Ok(bytes as u64)
}

/// `bytes` in the largest binary unit that keeps it at least 1, for
/// messages.
pub fn human(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", units[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_are_read_in_kilobytes() {
        let status = "Name:\tkv-eval\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n";
        assert_eq!(status_kb(status, "VmRSS:"), Some(1024 * 1024));
        assert_eq!(status_kb(status, "VmHWM:"), Some(2048 * 1024));
        assert_eq!(status_kb(status, "VmSwap:"), None);
        assert_eq!(status_kb("VmRSS: lots kB", "VmRSS:"), None);
    }

    #[test]
    fn available_memory_is_the_machines_or_the_cgroups() {
        let info = "MemTotal: 100 kB\nMemAvailable:    2048 kB\n";
        assert_eq!(mem_available(info), Some(2 << 20));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(cgroup_room("max\n", "123\n"), None);
        assert_eq!(cgroup_room("1000\n", "300\n"), Some(700));
        assert_eq!(cgroup_room("1000", "3000"), Some(0));
    }

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("1000").unwrap(), 1000);
        assert_eq!(parse_size("24G").unwrap(), 24 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5g").unwrap(), 3 << 29);
        assert_eq!(parse_size("8kb").unwrap(), 8 << 10);
        // Whole bytes exactly, the largest included (no f64 rounding).
        assert_eq!(parse_size("18446744073709551615").unwrap(), u64::MAX);
        for bad in ["", "G", "-1G", "0", "12X", "nanG", "1e30T", "inf"] {
            assert!(
                matches!(
                    parse_size(bad),
                    Err(EvalError::InvalidParameter {
                        name: "memory-limit",
                        ..
                    })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn over_budget_is_an_error_naming_the_sizes() {
        let budget = Budget {
            bytes: 1 << 30,
            explicit: true,
        };
        assert!(check_against(budget, "a pool", 1 << 30).is_ok());
        let e = check_against(budget, "the paged pool of 9 tokens", (1 << 30) + 1).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("the paged pool of 9 tokens"), "{text}");
        assert!(
            text.contains("1.0 GiB") && text.contains("--memory-limit"),
            "{text}"
        );
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(12), "12 B");
    }

    #[test]
    fn the_default_budget_is_a_share_of_what_is_available() {
        if let Some(available) = available_bytes() {
            assert!(available > 0);
            let b = Budget {
                bytes: (available as f64 * DEFAULT_SHARE) as u64,
                explicit: false,
            };
            let e = check_against(b, "everything", available).unwrap_err();
            assert!(e.to_string().contains("80% of the memory available"), "{e}");
        }
    }
}
