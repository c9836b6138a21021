//! The model repository's flags in the binary, Triton's names first
//! (`--model-repository`/`--model-store`, `--model-control-mode`, `--load-model`,
//! `--repository-poll-secs`, `--strict-readiness`, `--disable-auto-complete-config`),
//! and what `kiln serve` does with them at start ([`RepositoryArgs::start`]).
//! The modes themselves are kiln-core's ([`kiln_core::load::model_control`]).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use kiln_core::load::model_control::{Mode, ModelControl, Poller};
use kiln_core::Server;

/// The model repository and its control (docs/models.md, "Model control").
#[derive(Args, Debug, Clone)]
pub struct RepositoryArgs {
    /// Model repository: one folder per model with a config.toml or Triton's
    /// config.pbtxt, and version folders.
    #[arg(long, visible_alias = "model-store", env = "KILN_MODEL_REPOSITORY")]
    pub model_repository: Option<PathBuf>,
    /// Triton's model control: `none` loads every repository model at start and
    /// refuses the repository API's load and unload; `poll` does the same and
    /// rescans the repository every --repository-poll-secs; `explicit` (kiln's
    /// default; Triton's is `none`) loads only --load-model's models and lets
    /// clients load and unload.
    #[arg(long, env = "KILN_MODEL_CONTROL_MODE", default_value = "explicit", value_parser = Mode::parse)]
    pub model_control_mode: Mode,
    /// Load a repository model at start, in `explicit` mode (repeatable; `*` loads
    /// every model; env: `;`-separated).
    #[arg(long = "load-model", env = "KILN_LOAD_MODEL", value_delimiter = ';')]
    pub load_model: Vec<String>,
    /// Seconds between two scans of the repository in `poll` mode (fractions
    /// allowed).
    #[arg(long, env = "KILN_REPOSITORY_POLL_SECS", default_value_t = 15.0)]
    pub repository_poll_secs: f64,
    /// Ready (`/v2/health/ready`, gRPC ServerReady) only while every loaded model
    /// is ready; `false`: ready whenever the server is live and not stopping.
    #[arg(long, env = "KILN_STRICT_READINESS", default_value_t = true, action = clap::ArgAction::Set)]
    pub strict_readiness: bool,
    /// Complete no config.pbtxt from its model: a worker model's config must
    /// declare every input and output of the model, or its load fails.
    #[arg(long, env = "KILN_DISABLE_AUTO_COMPLETE_CONFIG")]
    pub disable_auto_complete_config: bool,
}

impl RepositoryArgs {
    /// The model control the flags ask for.
    pub fn control(&self) -> ModelControl {
        ModelControl {
            mode: self.model_control_mode,
            strict_readiness: self.strict_readiness,
            strict_config: self.disable_auto_complete_config,
        }
    }

    /// Loads the models the mode serves at start (a failed load stops the start,
    /// as Triton's `--exit-on-error` does by default); in `poll` mode, returns the
    /// poller to run and its interval.
    pub async fn start(&self, server: &Server) -> Result<Option<(Poller, Duration)>, String> {
        let mode = self.model_control_mode;
        if mode != Mode::Explicit && self.model_repository.is_none() {
            return Err(format!(
                "--model-control-mode {} serves a repository: set --model-repository",
                mode.as_str()
            ));
        }
        let poller = match mode {
            Mode::Poll => {
                let every = Duration::try_from_secs_f64(self.repository_poll_secs)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| {
                        format!(
                            "--repository-poll-secs {}: a positive number of seconds",
                            self.repository_poll_secs
                        )
                    })?;
                // Before the loads: a change made meanwhile is seen by the first scan.
                Some((
                    Poller::new(server.clone()).map_err(|e| e.to_string())?,
                    every,
                ))
            }
            _ => None,
        };
        let every_model = || -> Result<Vec<String>, String> {
            Ok(server
                .repository_index()
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|e| e.name)
                .collect())
        };
        let models = match mode {
            Mode::Explicit => {
                let mut models = Vec::new();
                for name in &self.load_model {
                    if name == "*" {
                        models.extend(every_model()?);
                    } else {
                        models.push(name.clone());
                    }
                }
                models
            }
            Mode::None | Mode::Poll => {
                if !self.load_model.is_empty() {
                    spdlog::warn!(
                        "--load-model is ignored: --model-control-mode {} loads every model",
                        mode.as_str()
                    );
                }
                every_model()?
            }
        };
        for name in models {
            let endpoint = server
                .load_model(&name, None, Vec::new())
                .await
                .map_err(|e| format!("loading model `{name}` at start: {e}"))?;
            spdlog::info!("serving model `{endpoint}`");
        }
        Ok(poller)
    }
}
