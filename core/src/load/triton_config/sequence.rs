//! A `config.pbtxt`'s `sequence_batching` → the sequence batcher's load parameters
//! ([`crate::group::sequence`]): the strategy, the idle timeout, the control inputs kiln
//! fills in, and each implicit state. What kiln does not honour is refused by name
//! ([`HONOURED`] for the fields; control values other than 0 and 1 here).

use kiln_worker_sdk::ParamValue;

use super::proto::model_sequence_batching::{control::Kind, Control, StrategyChoice};
use super::proto::{DataType, ModelSequenceBatching};

/// The `sequence_batching` fields kiln honours (see [`super::Parsed::fields`]).
pub const HONOURED: &[&str] = &[
    "sequence_batching",
    "sequence_batching.direct",
    "sequence_batching.direct.max_queue_delay_microseconds",
    "sequence_batching.oldest",
    "sequence_batching.oldest.max_candidate_sequences",
    "sequence_batching.oldest.preferred_batch_size",
    "sequence_batching.oldest.max_queue_delay_microseconds",
    "sequence_batching.max_sequence_idle_microseconds",
    "sequence_batching.control_input.name",
    "sequence_batching.control_input.control",
    "sequence_batching.control_input.control.kind",
    "sequence_batching.control_input.control.int32_false_true",
    "sequence_batching.control_input.control.fp32_false_true",
    "sequence_batching.control_input.control.bool_false_true",
    "sequence_batching.control_input.control.data_type",
    "sequence_batching.state.input_name",
    "sequence_batching.state.output_name",
    "sequence_batching.state.data_type",
    "sequence_batching.state.dims",
    "sequence_batching.state.initial_state",
    "sequence_batching.state.initial_state.name",
    "sequence_batching.state.initial_state.data_type",
    "sequence_batching.state.initial_state.dims",
    "sequence_batching.state.initial_state.zero_data",
];

/// `max_sequence_backlog` for a Triton model (see [`map`]).
const BACKLOG: i64 = 4096;

/// Sets the parameters of `s` (the batcher, its strategy and limits, controls and
/// states) through `set`; returns the control and state inputs with the data
/// types the file gives them, for [`super::autocomplete::Declared`] to check against
/// the model's.
pub fn map(
    s: &ModelSequenceBatching,
    set: &mut impl FnMut(&str, ParamValue),
) -> Result<Vec<(String, kiln_worker_sdk::DataType)>, String> {
    let mut typed = Vec::new();
    let int = |v: u64| ParamValue::Int(i64::try_from(v).unwrap_or(i64::MAX));
    set("batcher", ParamValue::Str("sequence".into()));
    // Triton holds a new sequence that finds every slot taken in a backlog of no
    // bound of its own; kiln's backlog is bounded, and the group's `queue_size`
    // (default 4096) bounds the requests queued, backlogged ones included: a backlog
    // of that many sequences is Triton's in effect.
    set("max_sequence_backlog", ParamValue::Int(BACKLOG));
    match &s.strategy_choice {
        // Triton's default strategy.
        None => set("sequence_strategy", ParamValue::Str("direct".into())),
        Some(StrategyChoice::Direct(d)) => {
            set("sequence_strategy", ParamValue::Str("direct".into()));
            set(
                "max_queue_delay_microseconds",
                int(d.max_queue_delay_microseconds),
            );
        }
        Some(StrategyChoice::Oldest(o)) => {
            set("sequence_strategy", ParamValue::Str("oldest".into()));
            set(
                "max_queue_delay_microseconds",
                int(o.max_queue_delay_microseconds),
            );
            if o.max_candidate_sequences > 0 {
                set(
                    "max_candidate_sequences",
                    ParamValue::Int(o.max_candidate_sequences.into()),
                );
            }
            if !o.preferred_batch_size.is_empty() {
                let list: Vec<String> = o.preferred_batch_size.iter().map(i32::to_string).collect();
                set(
                    "preferred_batch_size",
                    ParamValue::Str(list.join(",").as_str().into()),
                );
            }
        }
    }
    if s.max_sequence_idle_microseconds > 0 {
        set(
            "max_sequence_idle_microseconds",
            int(s.max_sequence_idle_microseconds),
        );
    }
    for input in &s.control_input {
        let control = match &input.control[..] {
            [one] => one,
            _ => {
                return Err(format!(
                    "`sequence_batching.control_input` `{}`: one `control` per input",
                    input.name
                ))
            }
        };
        let key = match control.kind() {
            Kind::ControlSequenceStart => "control.start",
            Kind::ControlSequenceEnd => "control.end",
            Kind::ControlSequenceReady => "control.ready",
            Kind::ControlSequenceCorrid => "control.corrid",
        };
        let dtype = if control.kind() == Kind::ControlSequenceCorrid {
            control.data_type()
        } else {
            zero_one(&input.name, control)?
        };
        typed.push((input.name.clone(), data_type(&input.name, dtype)?));
        set(key, ParamValue::Str(input.name.as_str().into()));
    }
    for state in &s.state {
        if state.input_name.is_empty() || state.output_name.is_empty() {
            return Err("`sequence_batching.state` needs `input_name` and `output_name`".into());
        }
        match &state.initial_state[..] {
            [] => {}
            // Zeros: the sequence batcher's own start (the data type and dims are
            // the state's, checked against the model with it).
            [initial] if initial.dims.is_empty() || initial.dims == state.dims => {}
            [initial] => {
                return Err(format!(
                    "state `{}`: `initial_state.dims` {:?} differ from the state's {:?}",
                    state.input_name, initial.dims, state.dims
                ))
            }
            _ => {
                return Err(format!(
                    "state `{}`: kiln takes one `initial_state`",
                    state.input_name
                ))
            }
        }
        set(
            &format!("state.{}", state.input_name),
            ParamValue::Str(state.output_name.as_str().into()),
        );
        if !state.dims.is_empty() {
            let dims: Vec<String> = state.dims.iter().map(i64::to_string).collect();
            set(
                &format!("state_dims.{}", state.input_name),
                ParamValue::Str(dims.join(",").as_str().into()),
            );
        }
        typed.push((
            state.input_name.clone(),
            data_type(&state.input_name, state.data_type())?,
        ));
    }
    Ok(typed)
}

/// kiln's datatype of a control or state input's `data_type`.
fn data_type(name: &str, dtype: DataType) -> Result<kiln_worker_sdk::DataType, String> {
    crate::ensemble::config::parse_data_type(dtype.as_str_name())
        .ok_or_else(|| format!("`{name}`: set its `data_type` ({})", dtype.as_str_name()))
}

/// kiln's control inputs carry 0 (false) and 1 (true), Triton's usual
/// `int32_false_true: [0, 1]` (and its FP32 and BOOL forms); other values are
/// refused. The data type the values give the input.
fn zero_one(name: &str, control: &Control) -> Result<DataType, String> {
    let typed = match (
        &control.int32_false_true[..],
        &control.fp32_false_true[..],
        &control.bool_false_true[..],
    ) {
        ([0, 1], [], []) => Some(DataType::TypeInt32),
        ([], [], [false, true]) => Some(DataType::TypeBool),
        ([], [f, t], []) if *f == 0.0 && *t == 1.0 => Some(DataType::TypeFp32),
        _ => None,
    };
    if let Some(dtype) = typed {
        Ok(dtype)
    } else {
        Err(format!(
            "control input `{name}`: kiln's control values are false = 0 and true = 1 \
             (`int32_false_true: [ 0, 1 ]`, `fp32_false_true: [ 0, 1 ]` or \
             `bool_false_true: [ false, true ]`)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse;
    use super::*;

    fn params(text: &str) -> Result<Vec<(String, String)>, String> {
        let parsed = parse(&format!("sequence_batching {{ {text} }}"))?;
        let Some(super::super::proto::model_config::SchedulingChoice::SequenceBatching(s)) =
            &parsed.config.scheduling_choice
        else {
            return Err("no sequence_batching".into());
        };
        let mut out = Vec::new();
        let typed = map(s, &mut |k, v| out.push((k.to_owned(), format!("{v:?}"))))?;
        out.extend(
            typed
                .into_iter()
                .map(|(name, dtype)| (format!("type {name}"), format!("{dtype:?}"))),
        );
        Ok(out)
    }

    fn get<'a>(p: &'a [(String, String)], key: &str) -> Option<&'a str> {
        p.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    #[test]
    fn strategies_controls_and_states_become_parameters() {
        let p = params(
            r#"max_sequence_idle_microseconds: 5000000
               oldest { max_candidate_sequences: 4 preferred_batch_size: [ 2, 4 ] }
               control_input [
                 { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
                 { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
                 { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
               ]
               state [ { input_name: "state" output_name: "stateN" data_type: TYPE_FP32
                         dims: [ 2, 1, 128 ]
                         initial_state: { data_type: TYPE_FP32 dims: [ 2, 1, 128 ] zero_data: true name: "zeros" } } ]"#,
        )
        .unwrap();
        assert!(get(&p, "batcher").unwrap().contains("sequence"));
        assert_eq!(get(&p, "max_sequence_backlog"), Some("Int(4096)"));
        assert!(get(&p, "sequence_strategy").unwrap().contains("oldest"));
        assert_eq!(get(&p, "max_candidate_sequences"), Some("Int(4)"));
        assert!(get(&p, "preferred_batch_size").unwrap().contains("2,4"));
        assert_eq!(
            get(&p, "max_sequence_idle_microseconds"),
            Some("Int(5000000)")
        );
        assert!(get(&p, "control.start").unwrap().contains("START"));
        assert!(get(&p, "control.ready").unwrap().contains("READY"));
        assert!(get(&p, "control.corrid").unwrap().contains("CORRID"));
        assert!(get(&p, "state.state").unwrap().contains("stateN"));
        assert!(get(&p, "state_dims.state").unwrap().contains("2,1,128"));
        // The types the file gives them, for the check against the model.
        assert_eq!(get(&p, "type START"), Some("Int32"));
        assert_eq!(get(&p, "type READY"), Some("Bool"));
        assert_eq!(get(&p, "type CORRID"), Some("Uint64"));
        assert_eq!(get(&p, "type state"), Some("Fp32"));
        // No strategy: Triton's direct.
        let p = params("max_sequence_idle_microseconds: 1").unwrap();
        assert!(get(&p, "sequence_strategy").unwrap().contains("direct"));
    }

    #[test]
    fn what_kiln_cannot_do_is_named() {
        for (text, says) in [
            (
                r#"control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 1, 0 ] } ] } ]"#,
                "control input `S`: kiln's control values",
            ),
            (
                r#"control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START }, { kind: CONTROL_SEQUENCE_END } ] } ]"#,
                "one `control` per input",
            ),
            (
                r#"state [ { input_name: "s" output_name: "t" data_type: TYPE_FP32 dims: [ 2 ] initial_state [ { zero_data: true dims: [ 3 ] } ] } ]"#,
                "`initial_state.dims` [3]",
            ),
            (
                r#"state [ { input_name: "s" } ]"#,
                "needs `input_name` and `output_name`",
            ),
            (
                r#"state [ { input_name: "s" output_name: "t" } ]"#,
                "`s`: set its `data_type`",
            ),
            (
                r#"control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID } ] } ]"#,
                "`C`: set its `data_type`",
            ),
        ] {
            let e = params(text).unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
