//! A request's way through the core, in the order it takes it: the protocol-free
//! request and its validation ([`infer`]), the one inference path every ingress
//! takes ([`serve`]: admission, tracing, logging, delivery, cancellation), how the
//! request is answered once its batch has run ([`answer`]), and the order answers
//! leave in ([`ordering`]). The group that admits and batches it is [`crate::group`];
//! the instance that runs its batch is in [`crate::compute`].

pub mod answer;
pub mod infer;
pub mod ordering;
pub mod serve;
