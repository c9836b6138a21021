//! The Redis store's connections (a small pool of synchronous clients, each call
//! under a timeout) and its scripts' invocation (`EVALSHA`, loaded again when
//! Redis lost them).

use std::time::Duration;

use parking_lot::Mutex;
use redis::Connection;

use super::{GROUP, PREFIX};
use crate::queue::{JobsError, Result};

/// Most idle connections kept for reuse.
const MAX_IDLE: usize = 16;
/// How long one Redis call may take before it is an error.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// A Redis error as the store's.
pub fn store<E: std::fmt::Display>(e: E) -> JobsError {
    JobsError::Store(format!("redis: {e}"))
}

/// A Lua script and its SHA1 (as `SCRIPT LOAD` answered).
pub struct Script {
    source: String,
    sha: String,
}

impl Script {
    /// Loads `source` into Redis (`SCRIPT LOAD`).
    pub fn load(source: String, con: &mut Connection) -> Result<Script> {
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(&source)
            .query(con)
            .map_err(store)?;
        Ok(Script { source, sha })
    }
}

/// Connections to one Redis server: made on demand, up to [`MAX_IDLE`] kept.
pub struct Pool {
    client: redis::Client,
    idle: Mutex<Vec<Connection>>,
}

impl Pool {
    /// A pool for `url` (`redis://HOST:PORT/DB`), checked by connecting once.
    pub fn open(url: &str) -> Result<Pool> {
        let client = redis::Client::open(url)
            .map_err(|e| JobsError::Config(format!("--jobs {url}: {e}")))?;
        let con = connect(&client)
            .map_err(|e| JobsError::Config(format!("--jobs {url}: cannot connect: {e}")))?;
        Ok(Pool {
            client,
            idle: Mutex::new(vec![con]),
        })
    }

    /// An idle connection, or a new one.
    pub fn take(&self) -> Result<Connection> {
        let pooled = self.idle.lock().pop();
        match pooled {
            Some(con) => Ok(con),
            None => connect(&self.client).map_err(store),
        }
    }

    /// Gives a working connection back.
    pub fn put(&self, con: Connection) {
        let mut idle = self.idle.lock();
        if idle.len() < MAX_IDLE {
            idle.push(con);
        }
    }

    /// Runs `f` on a pooled connection; a connection that failed is dropped.
    pub fn with<T>(&self, f: impl FnOnce(&mut Connection) -> redis::RedisResult<T>) -> Result<T> {
        let mut con = self.take()?;
        let result = f(&mut con);
        match &result {
            Err(e) if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() => {}
            _ => self.put(con),
        }
        result.map_err(store)
    }

    /// `EVALSHA` of `script` with the prefix, the group and `args`; loads it
    /// again when Redis lost it (restarted without its scripts).
    pub fn eval<T: redis::FromRedisValue>(&self, script: &Script, args: &[&[u8]]) -> Result<T> {
        self.with(|con| {
            let call = |sha: &str, con: &mut Connection| {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(sha).arg(0).arg(PREFIX).arg(GROUP);
                for a in args {
                    cmd.arg(*a);
                }
                cmd.query::<T>(con)
            };
            match call(&script.sha, con) {
                Err(e) if e.code() == Some("NOSCRIPT") => {
                    let sha: String = redis::cmd("SCRIPT")
                        .arg("LOAD")
                        .arg(&script.source)
                        .query(con)?;
                    call(&sha, con)
                }
                other => other,
            }
        })
    }
}

fn connect(client: &redis::Client) -> redis::RedisResult<Connection> {
    let con = client.get_connection_with_timeout(IO_TIMEOUT)?;
    con.set_read_timeout(Some(IO_TIMEOUT))?;
    con.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(con)
}
