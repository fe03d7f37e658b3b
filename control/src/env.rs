//! How the crates' `config.rs` read their `POSSUM_*` environment variables: through a lookup
//! (a variable's value, `None` when unset), the process's environment or, in tests, given
//! variables.

use std::ffi::OsString;
use std::path::PathBuf;

/// Typed settings read from environment variables.
pub trait EnvConfig: Sized {
    /// The settings `get` gives (a variable's value, `None` when unset).
    fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Self;

    /// The settings of this process's environment.
    fn from_env() -> Self {
        Self::from_lookup(|k| std::env::var_os(k))
    }

    /// The settings of the variables `vars` (name, value) alone (tests).
    fn from_vars(vars: &[(&str, &str)]) -> Self {
        Self::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.into()))
    }
}

/// A path variable's value as `get` gives it (see [`EnvConfig::from_lookup`]): `None` when unset
/// or empty.
pub fn path_var(get: impl Fn(&str) -> Option<OsString>, key: &str) -> Option<PathBuf> {
    get(key).filter(|v| !v.is_empty()).map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct Two(Option<PathBuf>, Option<OsString>);

    impl EnvConfig for Two {
        fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Self {
            Two(path_var(&get, "A"), get("B"))
        }
    }

    #[test]
    fn given_variables_alone_and_empty_paths_unset() {
        assert_eq!(
            Two::from_vars(&[("A", "/a"), ("B", "")]),
            Two(Some(PathBuf::from("/a")), Some(OsString::new()))
        );
        assert_eq!(Two::from_vars(&[("A", ""), ("C", "c")]), Two(None, None));
    }
}
