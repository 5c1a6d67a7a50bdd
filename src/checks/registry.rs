//! The tables of check kinds. `table!` turns a list of `module::Kind` lines
//! into the modules, the list of names, and the two ways a spec writes a
//! check (bare, or `{NAME: VALUE}`). `stage/mod.rs` and `run/mod.rs` invoke
//! it: adding a kind is its file plus one line there, and nothing else in the
//! harness names kinds.

/// `table!(StageRule; finite::Finite, …)` declares each module (a file
/// beside the invoking `mod.rs`), re-exports each kind, and defines:
/// - `NAMES`: every kind's name, in table order (error messages, suggestions);
/// - `KINDS`: every kind's (name, parameters, what must hold), for `touchstone checks`;
/// - `bare(name)`: the kind written bare, with its defaults;
/// - `with_value(name, map)`: the kind written `{name: VALUE}`, VALUE parsed
///   in place from the spec's YAML (so its errors keep their line:col).
macro_rules! table {
    ($rule:ident; $($module:ident :: $kind:ident),* $(,)?) => {
        $(mod $module;)*
        $(pub use $module::$kind;)*

        /// Every kind's name, in table order.
        pub const NAMES: &[&str] = &[$(<$module::$kind as $crate::checks::kind::Kind>::NAME),*];

        /// Every kind's (name, parameters, what must hold), in table order.
        pub const KINDS: &[(&str, &str, &str)] = &[$((
            <$module::$kind as $crate::checks::kind::Kind>::NAME,
            <$module::$kind as $crate::checks::kind::Kind>::PARAMS,
            <$module::$kind as $crate::checks::kind::Kind>::ABOUT,
        )),*];

        /// The kind called `name`, written bare.
        pub fn bare(name: &str) -> Option<std::sync::Arc<dyn $crate::checks::kind::$rule>> {
            $(
                if name == <$module::$kind as $crate::checks::kind::Kind>::NAME {
                    return Some(std::sync::Arc::new(<$module::$kind as $crate::checks::kind::Kind>::bare()));
                }
            )*
            None
        }

        /// The kind called `name`, written `{name: VALUE}`, VALUE being the
        /// map's next value; `Ok(None)` when no kind has that name.
        pub fn with_value<'de, A: serde::de::MapAccess<'de>>(
            name: &str,
            map: &mut A,
        ) -> Result<Option<std::sync::Arc<dyn $crate::checks::kind::$rule>>, A::Error> {
            $(
                if name == <$module::$kind as $crate::checks::kind::Kind>::NAME {
                    let k = map.next_value_seed($crate::checks::registry::Seed::<$module::$kind>::new())?;
                    return Ok(Some(std::sync::Arc::new(k)));
                }
            )*
            Ok(None)
        }
    };
}

pub(crate) use table;

use std::marker::PhantomData;

use serde::de::{self, DeserializeSeed, Deserializer};

use super::kind::Kind;

/// Parses the value of `{NAME: VALUE}` as kind `K`, in place (so serde_yaml
/// locates errors inside it), then checks what serde cannot.
pub struct Seed<K>(PhantomData<K>);

impl<K> Seed<K> {
    pub fn new() -> Seed<K> {
        Seed(PhantomData)
    }
}

impl<K> Default for Seed<K> {
    fn default() -> Self {
        Seed::new()
    }
}

impl<'de, K: Kind> DeserializeSeed<'de> for Seed<K> {
    type Value = K;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<K, D::Error> {
        let k = K::parse(d)?;
        k.check_params().map_err(de::Error::custom)?;
        Ok(k)
    }
}
