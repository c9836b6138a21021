//! Headless Chromium from Debian, driven over WebDriver (`fantoccini` talking to
//! `/usr/bin/chromedriver`), with a fake camera fed from a video FFmpeg generates:
//! what the page tests use. `scripts/setup-chromium` installs the three programs
//! (FFmpeg and the font it draws text with through `scripts/setup-ffmpeg`).

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::json;

/// Debian's Chromium.
const CHROMIUM: &str = "/usr/bin/chromium";
/// Debian's ChromeDriver (package `chromium-driver`), of the same version.
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// The folder a test leaves what a person may look at afterwards (screenshots,
/// the generated video): `target/test-output`, beside the build directory.
pub fn test_output_dir() -> PathBuf {
    let build = crate::build_dir();
    let dir = build.parent().unwrap_or(&build).join("test-output");
    std::fs::create_dir_all(&dir).expect("create the test output folder");
    dir
}

/// Whether Chromium, ChromeDriver and FFmpeg are installed. When one is missing a
/// test skips with `why` printed, except under CI (`CI=true`), where
/// `scripts/test` has installed them and a missing one fails the test.
pub fn browser_available(test: &str) -> bool {
    let ffmpeg = Command::new("ffmpeg")
        .arg("-version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let missing: Vec<&str> = [
        (Path::new(CHROMIUM).is_file(), CHROMIUM),
        (Path::new(CHROMEDRIVER).is_file(), CHROMEDRIVER),
        (ffmpeg, "ffmpeg"),
    ]
    .into_iter()
    .filter_map(|(present, name)| (!present).then_some(name))
    .collect();
    if missing.is_empty() {
        return true;
    }
    let why = format!(
        "{test}: {} not installed: run scripts/setup-chromium",
        missing.join(", ")
    );
    if std::env::var("CI").is_ok_and(|ci| ci == "true") {
        panic!("{why} (under CI this test does not skip)");
    }
    eprintln!("SKIPPED {why}");
    false
}

/// Generates, with FFmpeg's own sources, the video Chromium's fake camera plays
/// (`--use-file-for-fake-video-capture`, which reads Y4M): 4 s at 15 frames per
/// second of `testsrc2` (colour bars, a moving gradient, a running clock) over the
/// top 168 rows of 320×240, and a white band below with `KILN 2026` in black: a
/// picture whose inversion is far from itself, and text where the test knows it is
/// (rows [`TEXT_BAND`]). Written once (the same bytes each time), kept in
/// [`test_output_dir`] for a person to play.
pub fn fake_camera_video() -> PathBuf {
    // One writer per process (tests of one binary run on threads of one process,
    // so the pid alone would name the same partial file twice: CI saw one thread's
    // rename find the file already moved by the other); the pid keeps processes
    // apart.
    static WRITING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _writing = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    let path = test_output_dir().join("fake-camera.y4m");
    if path.is_file() {
        return path;
    }
    let partial = path.with_extension(format!("{}.y4m", std::process::id()));
    let filter = "testsrc2=size=320x240:rate=15,\
        drawbox=x=0:y=168:w=320:h=72:color=white:t=fill,\
        drawtext=fontfile=/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf:\
        text='KILN 2026':fontsize=44:fontcolor=black:x=30:y=180";
    let out = Command::new("ffmpeg")
        .args(["-hide_banner", "-loglevel", "error", "-y", "-f", "lavfi"])
        .args(["-i", filter, "-t", "4", "-pix_fmt", "yuv420p"])
        .arg(&partial)
        .output()
        .expect("run ffmpeg");
    assert!(
        out.status.success(),
        "ffmpeg could not generate the fake camera's video: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::rename(&partial, &path).expect("move the fake camera's video in place");
    path
}

/// The rows of the fake camera's frame holding the white band with the text.
pub const TEXT_BAND: std::ops::Range<u32> = 168..240;

/// ChromeDriver and the WebDriver session of a headless Chromium it started; both
/// end on drop (the session is closed by [`Browser::close`] when the test gets that
/// far).
pub struct Browser {
    pub client: fantoccini::Client,
    driver: Child,
    profile: PathBuf,
}

impl Browser {
    /// Starts ChromeDriver on a free loopback port and, through it, headless
    /// Chromium with a fresh profile, fake media devices (every permission
    /// granted, the camera playing `camera`), and nothing that reaches out to the
    /// network (this machine has none).
    pub async fn start(camera: &Path) -> Browser {
        // A process group of its own, which the Chromium it starts joins: a test
        // that fails before closing its session still ends every process of it.
        let mut driver = Command::new(CHROMEDRIVER)
            .process_group(0)
            .arg("--port=0")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let port = driver_port(&mut driver);
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let profile = std::env::temp_dir().join(format!(
            "kiln-chromium-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&profile);
        std::fs::create_dir_all(&profile).expect("create the Chromium profile folder");
        let args = [
            "--headless".to_owned(),
            "--no-sandbox".to_owned(),
            "--disable-gpu".to_owned(),
            "--disable-quic".to_owned(),
            "--no-first-run".to_owned(),
            "--disable-background-networking".to_owned(),
            "--disable-component-update".to_owned(),
            "--disable-sync".to_owned(),
            "--disable-dev-shm-usage".to_owned(),
            "--window-size=1400,1000".to_owned(),
            "--use-fake-ui-for-media-stream".to_owned(),
            "--use-fake-device-for-media-stream".to_owned(),
            format!("--use-file-for-fake-video-capture={}", camera.display()),
            format!("--user-data-dir={}", profile.display()),
        ];
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".to_owned(),
            json!({"binary": CHROMIUM, "args": args}),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = fantoccini::ClientBuilder::new(connector)
            .capabilities(capabilities)
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
            .expect("a WebDriver session in headless Chromium");
        Browser {
            client,
            driver,
            profile,
        }
    }

    /// Runs `script` (a function body; `arguments` are `args`) in the page and
    /// returns its value.
    pub async fn eval(&self, script: &str, args: Vec<serde_json::Value>) -> serde_json::Value {
        self.client
            .execute(script, args)
            .await
            .unwrap_or_else(|e| panic!("the page's script failed: {e}\n{script}"))
    }

    /// Waits until `script` returns `true`, up to `within`; returns whether it did.
    pub async fn wait_until(&self, script: &str, within: Duration) -> bool {
        let deadline = std::time::Instant::now() + within;
        loop {
            if self.eval(script, vec![]).await == json!(true) {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Saves a screenshot of the window as `name` in [`test_output_dir`], prints
    /// and returns its path.
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let png = self.client.screenshot().await.expect("a screenshot");
        let path = test_output_dir().join(name);
        std::fs::write(&path, png).expect("write the screenshot");
        println!("screenshot: {}", path.display());
        path
    }

    /// Ends the WebDriver session (Chromium exits), then ChromeDriver.
    pub async fn close(self) {
        let _ = self.client.clone().close().await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // ChromeDriver, and the Chromium processes in its group (a closed session
        // has ended them already).
        if let Ok(group) = i32::try_from(self.driver.id()) {
            // SAFETY: kill(2) with a negative pid signals that process group: the
            // one made for ChromeDriver at spawn, which is still ours to reap.
            unsafe { libc::kill(-group, libc::SIGKILL) };
        }
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// The port ChromeDriver chose for `--port=0`, from the line it prints once it
/// listens ("ChromeDriver was started successfully on port N.").
fn driver_port(driver: &mut Child) -> u16 {
    let stdout = driver.stdout.take().expect("chromedriver's stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        for line in lines.by_ref().map_while(Result::ok) {
            if let Some(port) = line
                .split("started successfully on port ")
                .nth(1)
                .and_then(|rest| rest.trim_end_matches('.').trim().parse::<u16>().ok())
            {
                let _ = tx.send(port);
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("chromedriver did not say which port it listens on")
}
