//! `optimization.execution_accelerators` → the onnx worker's execution provider.
//!
//! Triton's ONNX Runtime backend takes `tensorrt` and `cuda` on GPU instances
//! (`gpu_execution_accelerator`) and `openvino` on CPU ones
//! (`cpu_execution_accelerator`). kiln's onnx worker has ONNX Runtime's CPU and
//! CUDA providers, so:
//!
//! | Triton                                             | kiln                          |
//! |----------------------------------------------------|-------------------------------|
//! | `gpu_execution_accelerator [{ name: "cuda" }]`     | `execution_provider = "cuda"` (an instance group that is not `KIND_CPU`) |
//! | any other accelerator (`tensorrt`, `openvino`, …)  | a load error naming it        |
//! | an accelerator's `parameters`                      | a load error naming the field |
//!
//! `parameters` is refused by the mapper's field check ([`super::map`]): only
//! the names below are honoured.

use kiln_worker_sdk::ParamValue;

use super::proto::{model_instance_group::Kind, ModelConfig};

/// The fields of `optimization.execution_accelerators` kiln honours (the names
/// are checked here).
pub const HONOURED: &[&str] = &[
    "optimization.execution_accelerators.gpu_execution_accelerator.name",
    "optimization.execution_accelerators.cpu_execution_accelerator.name",
];

/// The accelerators of `c`, run by `worker`, as its parameters.
pub fn map(
    c: &ModelConfig,
    worker: &str,
    set: &mut impl FnMut(&str, ParamValue),
) -> Result<(), String> {
    let Some(accelerators) = c
        .optimization
        .as_ref()
        .and_then(|o| o.execution_accelerators.as_ref())
    else {
        return Ok(());
    };
    let field = "`optimization.execution_accelerators`";
    if let Some(a) = accelerators.cpu_execution_accelerator.first() {
        return Err(format!(
            "{field}: CPU accelerator `{}` is not available in kiln (its CPU instances \
             run ONNX Runtime's default CPU provider)",
            a.name
        ));
    }
    let gpu = &accelerators.gpu_execution_accelerator;
    if let Some(a) = gpu.iter().find(|a| a.name != "cuda") {
        return Err(format!(
            "{field}: GPU accelerator `{}` is not available in kiln (it has ONNX \
             Runtime's `cuda` provider)",
            a.name
        ));
    }
    if gpu.is_empty() {
        return Ok(());
    }
    if worker != "onnx" {
        return Err(format!(
            "{field}: only ONNX Runtime models take accelerators"
        ));
    }
    let kinds: Vec<Kind> = c.instance_group.iter().map(|g| g.kind()).collect();
    if kinds.contains(&Kind::Cpu) {
        return Err(format!(
            "{field}: `cuda` applies to GPU instances, and this model's instance \
             group is KIND_CPU"
        ));
    }
    // KIND_GPU already chose the CUDA provider (map.rs, `instance_group`).
    if !kinds.contains(&Kind::Gpu) {
        set("execution_provider", ParamValue::Str("cuda".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::map::{map as map_config, Mapped};
    use super::super::parse;

    fn provider(text: &str) -> Result<Option<String>, String> {
        match map_config("m", &parse(text).unwrap(), true)? {
            Mapped::Worker { params, .. } => Ok(params
                .iter()
                .find(|p| p.key.as_str() == "execution_provider")
                .map(|p| format!("{:?}", p.value))),
            Mapped::Ensemble { .. } => panic!("not a worker"),
        }
    }

    const ORT: &str = "backend: \"onnxruntime\" ";

    #[test]
    fn cuda_is_onnx_runtimes_cuda_provider() {
        let gpu = "optimization { execution_accelerators { gpu_execution_accelerator \
                   [ { name: \"cuda\" } ] } }";
        let p = provider(&format!("{ORT}{gpu}")).unwrap().unwrap();
        assert!(p.contains("cuda"), "{p}");
        let on_gpu = format!("{ORT}{gpu} instance_group [{{ kind: KIND_GPU gpus: [1] }}]");
        assert!(provider(&on_gpu).unwrap().unwrap().contains("cuda"));
        let on_cpu = format!("{ORT}{gpu} instance_group [{{ kind: KIND_CPU }}]");
        let e = provider(&on_cpu).unwrap_err();
        assert!(e.contains("KIND_CPU"), "{e}");
    }

    #[test]
    fn other_accelerators_and_their_parameters_are_refused_by_name() {
        for (accelerators, named) in [
            (
                "gpu_execution_accelerator [ { name: \"tensorrt\" } ]",
                "`tensorrt`",
            ),
            (
                "cpu_execution_accelerator [ { name: \"openvino\" } ]",
                "`openvino`",
            ),
            (
                "gpu_execution_accelerator [ { name: \"cuda\" parameters { key: \
                 \"cudnn_conv_algo_search\" value: \"1\" } } ]",
                "gpu_execution_accelerator.parameters",
            ),
        ] {
            let text =
                format!("{ORT}optimization {{ execution_accelerators {{ {accelerators} }} }}");
            let e = provider(&text).unwrap_err();
            assert!(e.contains(named), "{text}: {e}");
        }
    }
}
