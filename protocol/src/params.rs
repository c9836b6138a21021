//! Parameters as every ingress carries them.

/// Whether load parameter `key` takes a list: JSON's and TOML's `[4, 8]` (Triton's
/// `"preferred_batch_size": [4, 8]`) arrive as the text `"4,8"`, the form every
/// ingress shares.
pub fn takes_list(key: &str) -> bool {
    key.eq_ignore_ascii_case("preferred_batch_size")
}
