//! Runs NVIDIA's `tritonclient` (pytest files under `tests/`, in the virtualenv
//! `scripts/setup-tritonclient` creates) against a running kiln.

use std::ffi::OsStr;
use std::process::Command;

use crate::{cache_dir, repo_root, Kiln};

/// Runs pytest on `tests` (a file or folder, relative to the repository) with
/// `KILN_HTTP_URL` and `KILN_GRPC_URL` set to `kiln`'s `host:port`s and `env`
/// added; panics with pytest's output and kiln's log when it fails. Returns
/// pytest's standard output.
pub fn run_pytest(kiln: &Kiln, tests: &str, env: &[(&str, &OsStr)]) -> String {
    let python = cache_dir().join("tritonclient-venv/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run scripts/setup-tritonclient",
        python.display()
    );
    let host_port = |url: &str| url.trim_start_matches("http://").to_owned();
    let output = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", tests])
        .current_dir(repo_root())
        .env("KILN_HTTP_URL", host_port(&kiln.url))
        .env("KILN_GRPC_URL", host_port(&kiln.grpc_url))
        .envs(env.iter().copied())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("pytest runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "pytest failed:\n{stdout}\n{}\nkiln's log:\n{}",
        String::from_utf8_lossy(&output.stderr),
        kiln.log()
    );
    println!("{stdout}");
    stdout
}
