//! The process's descriptor limit (`RLIMIT_NOFILE`), and the connection caps
//! derived from it.
//!
//! Every connection holds a descriptor. Many systems start processes with a soft
//! limit of 1024 and a far higher hard one; a server keeping the soft limit runs
//! out of descriptors at about a thousand idle connections, after which neither
//! port accepts anyone. [`raise_to_hard`] lifts the soft limit to the hard one at
//! start, and [`default_max_connections`] keeps what the connections of one port
//! may take below it.

/// Descriptors kept out of the connection caps: plugin libraries, model files,
/// shared-memory regions, the log, the listeners.
const RESERVED: u64 = 256;

/// The soft and hard limits before and after [`raise_to_hard`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raised {
    /// The soft limit the process was started with.
    pub before: u64,
    /// The soft limit now (the hard limit, unless raising failed).
    pub soft: u64,
    /// The hard limit.
    pub hard: u64,
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit. Returns the limits, or the
/// error of `getrlimit`/`setrlimit` (then the limit is unchanged).
pub fn raise_to_hard() -> std::io::Result<Raised> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable `rlimit`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let before: u64 = limit.rlim_cur;
    let hard: u64 = limit.rlim_max;
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: `raised` is a valid `rlimit`; lowering nothing, raising the soft
        // limit up to the hard one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(Raised {
        before,
        soft: hard,
        hard,
    })
}

/// The current soft `RLIMIT_NOFILE` (1024 when it cannot be read).
pub fn soft_limit() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable `rlimit`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 1024;
    }
    limit.rlim_cur
}

/// The default cap on open connections of each of the two ports for a soft
/// descriptor limit of `soft`: half of what [`RESERVED`] leaves (one descriptor
/// per connection), at least 16.
pub fn default_max_connections(soft: u64) -> usize {
    let per_port = soft.saturating_sub(RESERVED) / 2;
    usize::try_from(per_port).unwrap_or(usize::MAX).max(16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_leave_room_for_both_ports() {
        assert_eq!(default_max_connections(1024), 384);
        assert_eq!(default_max_connections(100), 16);
        assert_eq!(default_max_connections(1 << 20), ((1 << 20) - 256) / 2);
    }
}
