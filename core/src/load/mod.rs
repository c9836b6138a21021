//! From disk to a loaded model: worker plugins (`plugin`), the model repository and
//! its folders (`repository`, `triton_config` for `config.pbtxt`), Triton's model
//! control (`model_control`) and the server-wide load limits (`limits`).

pub mod limits;
pub mod model_control;
pub mod plugin;
pub mod repository;
pub mod triton_config;
