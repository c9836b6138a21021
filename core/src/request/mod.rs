//! One request's life: validated against the model (`infer`), called through the
//! server's one path (`serve`), answered from its batch (`answer`), in order where the
//! model asks for it (`ordering`).

pub mod answer;
pub mod infer;
pub mod ordering;
pub mod serve;
