//! Settings as people write them: in a configuration file (deserialised with
//! serde), as key/value text, and in environment variables, for the adapters'
//! `*Settings` types.
//!
//! Each adapter has one settings struct whose fields are the keys of its
//! `[broker.<kind>]` section, every one optional (unset keeps the adapter's
//! default). Text reaches a field one way: its `with_config(key, value)`, which
//! reads the value as the file writes it ([`SettingField`]); its `with_vars` lays
//! the `OUTBOX_<BROKER>_*` variables over the settings through `with_config` (the
//! environment wins), reading them with [`Vars`]' rules. Its config's
//! `from_settings` turns the result into the typed configuration, setting what is
//! set with [`WithSetting::with_setting`]. The adapter declares the struct with
//! [`env_settings!`]: each field's variable is written once, next to the field. A
//! config's `from_vars` reads the settings and the envelope with
//! [`settings_and_envelope`]. A setting the adapter cannot use is a
//! [`ConfigError`], held by the adapter's `Error::Config`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::envelope::{Envelope, EnvelopeConfigError};

/// A duration written like `100ms`, `30s`, `5m`, `2h`, `1h 30m` or `7d`; `0` is zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    /// `secs` seconds.
    pub const fn secs(secs: u64) -> Self {
        Self(Duration::from_secs(secs))
    }

    /// `millis` milliseconds.
    pub const fn millis(millis: u64) -> Self {
        Self(Duration::from_millis(millis))
    }
}

impl From<HumanDuration> for Duration {
    fn from(d: HumanDuration) -> Self {
        d.0
    }
}

impl From<Duration> for HumanDuration {
    fn from(d: Duration) -> Self {
        Self(d)
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl FromStr for HumanDuration {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text == "0" {
            return Ok(Self(Duration::ZERO));
        }
        humantime::parse_duration(text).map(Self).map_err(|e| {
            format!("invalid duration `{text}` ({e}); write e.g. 500ms, 30s, 10m, 2h, 7d")
        })
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// For `#[serde(deserialize_with = "pgoutbox_core::settings::duration")]` on a
/// `Duration` field: written like [`HumanDuration`].
pub fn duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    HumanDuration::deserialize(deserializer).map(Duration::from)
}

/// Settings that environment variables can override: an adapter's
/// `*Settings` type. Implement [`EnvOverrides::with`]; the rest follows.
pub trait EnvOverrides: Sized {
    /// What a variable that cannot be read becomes: the adapter's error, holding
    /// the [`ConfigError`] that names the variable.
    type Error: From<ConfigError>;

    /// These settings with `vars` laid over them: each variable that is set
    /// replaces its setting.
    fn with(self, vars: &Vars) -> Result<Self, Self::Error>;

    /// These settings with the process environment laid over them.
    fn with_env(self) -> Result<Self, Self::Error> {
        self.with(&Vars::from_env())
    }

    /// These settings with these name/value pairs laid over them, as if they
    /// were the environment.
    fn with_vars<S: Into<String>>(
        self,
        vars: impl IntoIterator<Item = (S, S)>,
    ) -> Result<Self, Self::Error> {
        self.with(&Vars::new(vars))
    }
}

/// The default settings `S` with `vars` laid over them, and the envelope the same
/// variables choose (`OUTBOX_ENVELOPE`, `OUTBOX_CLOUDEVENTS_*`, read by
/// [`Envelope::from_lookup`]): what every adapter's config `from_vars` reads before
/// its `from_settings`. An invalid envelope setting is the adapter's error, as its
/// settings' variables are.
pub fn settings_and_envelope<S>(
    vars: impl IntoIterator<Item = (impl Into<String>, impl Into<String>)>,
) -> Result<(S, Envelope), S::Error>
where
    S: EnvOverrides + Default,
{
    let vars = Vars::new(vars);
    let settings = S::default().with(&vars)?;
    let envelope = Envelope::from_lookup(|name| vars.text(name))
        .map_err(|e| S::Error::from(ConfigError::from(e)))?;
    Ok((settings, envelope))
}

/// Declares an adapter's settings: the struct, an `ENV_*` constant for each
/// variable, its `with_config` and its [`EnvOverrides`] implementation, from one
/// list of fields. A variable is written once, on its field, so the struct, the
/// constants, the override code and the variable table in `with`'s docs cannot
/// drift apart.
///
/// Fields are written as in a struct, with their docs but without `pub`: settings
/// are plain data, every field public. Each is a [`SettingField`]: an `Option`
/// (unset keeps the adapter's default) or a map set one entry at a time. A field
/// that a variable overrides is marked `#[env(CONST = "VARIABLE")]` after its docs,
/// or `#[env(CONST = "VARIABLE", millis)]` when the variable is a duration in whole
/// milliseconds (the `*_MS` variables); the variable's value is the field's text
/// otherwise. Unmarked fields come from the file and `with_config` only. After the
/// struct, `type Error = ...;` is the adapter's error (it converts from
/// [`ConfigError`]); an optional `then step;` names a method
/// `fn(Self, &Vars) -> Result<Self, Error>` laying the variables a list cannot name
/// (those of a prefix) after the listed ones, and the docs written above it are
/// added to `with`'s.
///
/// The struct derives `Debug`, `Clone`, `Default`, `PartialEq`, `Eq` and serde's
/// `Deserialize` (the calling crate depends on `serde`), refuses unknown keys, takes
/// unset keys from `Default` and is `#[non_exhaustive]`, as every adapter's is.
///
/// ```
/// use pgoutbox_core::settings::{ConfigError, EnvOverrides, HumanDuration};
///
/// pgoutbox_core::settings::env_settings! {
///     /// A broker's settings.
///     pub struct BrokerSettings {
///         /// The broker's URL.
///         #[env(ENV_URL = "OUTBOX_BROKER_URL")]
///         url: Option<String>,
///         /// Longest wait for the broker.
///         #[env(ENV_TIMEOUT_MS = "OUTBOX_BROKER_TIMEOUT_MS", millis)]
///         timeout: Option<HumanDuration>,
///         /// A deployment decision: from the file only.
///         create_queues: Option<bool>,
///     }
///     type Error = ConfigError;
/// }
///
/// let settings = BrokerSettings::default()
///     .with_vars([(ENV_TIMEOUT_MS, "250"), ("UNRELATED", "x")])
///     .unwrap();
/// assert_eq!(settings.timeout, Some(HumanDuration::millis(250)));
/// assert_eq!(settings.url, None);
/// assert_eq!(ENV_URL, "OUTBOX_BROKER_URL");
///
/// let settings = settings.with_config("create_queues", "true").unwrap();
/// assert_eq!(settings.create_queues, Some(true));
/// let err = settings.with_config("timeout", "soon").unwrap_err();
/// assert_eq!(err.key, "timeout");
/// ```
#[doc(hidden)]
#[macro_export]
macro_rules! __env_settings {
    // A variable's value as the field's text: a `*_MS` variable is whole milliseconds,
    // the field a duration.
    (@text $vars:ident, $var:expr, millis) => {
        $vars
            .millis($var)
            .map_err($crate::settings::ConfigError::from)?
            .map(|duration| duration.to_string())
    };
    (@text $vars:ident, $var:expr, ) => { $vars.text($var) };
    // For the docs: the unit of a variable whose value is not written as in the file.
    (@unit millis) => { ", in milliseconds" };
    (@unit) => { "" };
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $(
                $(#[doc = $doc:expr])*
                $(#[env($const:ident = $var:literal $(, $unit:ident)?)])?
                $field:ident: $ty:ty,
            )*
        }
        type Error = $error:ty;
        $($(#[doc = $step_doc:expr])* then $step:ident;)?
    ) => {
        $($(
            #[doc = concat!(
                "Environment variable `", $var, "`: [`", stringify!($name), "::",
                stringify!($field), "`]", $crate::settings::env_settings!(@unit $($unit)?), ".",
            )]
            $vis const $const: &str = $var;
        )?)*

        $(#[$meta])*
        #[derive(Debug, Clone, Default, PartialEq, Eq, ::serde::Deserialize)]
        #[serde(deny_unknown_fields, default)]
        #[non_exhaustive]
        $vis struct $name {
            $(
                $(#[doc = $doc])*
                pub $field: $ty,
            )*
        }

        impl $name {
            /// These settings with the setting `key` (a key of the configuration
            /// file's section, e.g. `timeout`; a map's entry as `<key>.<name>`) set
            /// from `value`, written as the file writes it (`"5s"`, `"true"`, `"8"`).
            /// The one way text becomes a setting: the environment goes through it
            /// too. An unknown key or a value the setting cannot take is an error
            /// naming the key.
            $vis fn with_config(
                mut self,
                key: &str,
                value: &str,
            ) -> ::core::result::Result<Self, $error> {
                self.set_config(key, value)?;
                ::core::result::Result::Ok(self)
            }

            fn set_config(
                &mut self,
                key: &str,
                value: &str,
            ) -> ::core::result::Result<(), $crate::settings::ConfigError> {
                let (field, entry) = match key.split_once('.') {
                    ::core::option::Option::Some((field, entry)) => {
                        (field, ::core::option::Option::Some(entry))
                    }
                    ::core::option::Option::None => (key, ::core::option::Option::None),
                };
                let set = match field {
                    $(stringify!($field) => $crate::settings::SettingField::set_text(
                        &mut self.$field,
                        entry,
                        value,
                    ),)*
                    _ => {
                        let keys: &[&str] = &[$(stringify!($field)),*];
                        return ::core::result::Result::Err($crate::settings::ConfigError::new(
                            key,
                            ::std::format!("unknown setting (the settings: {})", keys.join(", ")),
                        ));
                    }
                };
                set.map_err(|reason| {
                    $crate::settings::ConfigError::new(key, ::std::format!("`{value}`: {reason}"))
                })
            }
        }

        impl $crate::settings::EnvOverrides for $name {
            type Error = $error;

            /// These settings with `vars` laid over them: each variable that is set
            /// replaces its setting.
            ///
            /// | variable | setting |
            /// |---|---|
            $($(
                #[doc = concat!(
                    "| `", $var, "` | `", stringify!($field), "`",
                    $crate::settings::env_settings!(@unit $($unit)?), " |",
                )]
            )?)*
            $($(#[doc = $step_doc])*)?
            fn with(
                mut self,
                vars: &$crate::settings::Vars,
            ) -> ::core::result::Result<Self, $error> {
                $($(
                    let text = $crate::settings::env_settings!(@text vars, $const, $($unit)?);
                    if let ::core::option::Option::Some(text) = text {
                        // The error names the variable, not the key.
                        self.set_config(stringify!($field), &text).map_err(|e| {
                            $crate::settings::ConfigError::new($const, e.reason)
                        })?;
                    }
                )?)*
                $(self = Self::$step(self, vars)?;)?
                ::core::result::Result::Ok(self)
            }
        }
    };
}

#[doc(inline)]
pub use crate::__env_settings as env_settings;

/// A field of an adapter's settings that text can set (see [`env_settings!`]'s
/// `with_config`): an `Option` of a [`SettingValue`], or a map of them set one
/// entry at a time.
pub trait SettingField {
    /// Set from `text`. `entry` is what followed the field's name and a `.` in the
    /// key: a map's entry, `None` for a plain field. The error says why.
    fn set_text(&mut self, entry: Option<&str>, text: &str) -> Result<(), String>;
}

impl<T: SettingValue> SettingField for Option<T> {
    fn set_text(&mut self, entry: Option<&str>, text: &str) -> Result<(), String> {
        if let Some(entry) = entry {
            return Err(format!("the setting has one value, no entry `{entry}`"));
        }
        *self = Some(T::from_text(text)?);
        Ok(())
    }
}

impl<T: SettingValue> SettingField for BTreeMap<String, T> {
    fn set_text(&mut self, entry: Option<&str>, text: &str) -> Result<(), String> {
        match entry.filter(|e| !e.is_empty()) {
            Some(entry) => {
                self.insert(entry.to_string(), T::from_text(text)?);
                Ok(())
            }
            None => Err("set one entry at a time: `<setting>.<name>`".into()),
        }
    }
}

/// A value a setting holds, read from its text as the configuration file writes it.
pub trait SettingValue: Sized {
    /// The value `text` writes; the error says why there is none.
    fn from_text(text: &str) -> Result<Self, String>;
}

/// As written: a URL, a name, a password are not trimmed.
impl SettingValue for String {
    fn from_text(text: &str) -> Result<Self, String> {
        Ok(text.to_string())
    }
}

impl SettingValue for PathBuf {
    fn from_text(text: &str) -> Result<Self, String> {
        Ok(PathBuf::from(text.trim()))
    }
}

impl SettingValue for HumanDuration {
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse()
    }
}

/// Values written as Rust's `FromStr` reads them, around blanks.
macro_rules! setting_value_from_str {
    ($($ty:ty),*) => {$(
        impl SettingValue for $ty {
            fn from_text(text: &str) -> Result<Self, String> {
                text.trim().parse().map_err(|e: <$ty as FromStr>::Err| e.to_string())
            }
        }
    )*};
}

setting_value_from_str!(bool, i32, i64, u16, u32, u64, usize);

/// Builder steps for the settings that are set, so a config's `from_settings` reads
/// as one line per setting: `Config::default().with_setting(&s.url, Config::url)`.
/// An adapter's config opts in with `impl WithSetting for Config {}`.
pub trait WithSetting: Sized {
    /// `set(self, value)` with the value of `setting` if it is set, else `self`
    /// unchanged (the default stays).
    fn with_setting<T: Clone>(
        self,
        setting: &Option<T>,
        set: impl FnOnce(Self, T) -> Self,
    ) -> Self {
        match setting {
            Some(value) => set(self, value.clone()),
            None => self,
        }
    }
}

/// An environment variable whose value could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("environment variable {var}=`{value}`: {reason}")]
#[non_exhaustive]
pub struct VarError {
    /// The variable.
    pub var: String,
    /// Its value.
    pub value: String,
    /// What is wrong with it.
    pub reason: String,
}

/// A setting an adapter cannot use: the key (a `[broker.<kind>]` key, an
/// `[envelope]` key or an environment variable) and why. Every adapter's
/// `Error::Config` holds one; [`VarError`] and [`EnvelopeConfigError`] convert into
/// it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {reason}")]
#[non_exhaustive]
pub struct ConfigError {
    /// The setting at fault: its key, its environment variable, or both (e.g.
    /// `password_file (OUTBOX_AMQP_PASSWORD_FILE)`).
    pub key: String,
    /// Why it was refused.
    pub reason: String,
}

impl ConfigError {
    /// `key` refused for `reason`.
    pub fn new(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            reason: reason.into(),
        }
    }
}

/// The variable is the key; the reason quotes the refused value.
impl From<VarError> for ConfigError {
    fn from(e: VarError) -> Self {
        Self::new(e.var, format!("`{}`: {}", e.value, e.reason))
    }
}

/// The key is the `[envelope]` setting at fault (`envelope.format`,
/// `envelope.source` or `envelope.subject`).
impl From<EnvelopeConfigError> for ConfigError {
    fn from(e: EnvelopeConfigError) -> Self {
        let key = match &e {
            EnvelopeConfigError::Unknown(_) | EnvelopeConfigError::Mode(_) => "envelope.format",
            EnvelopeConfigError::SourceMissing | EnvelopeConfigError::Source(_) => {
                "envelope.source"
            }
            EnvelopeConfigError::Subject { .. } => "envelope.subject",
        };
        Self::new(key, e.to_string())
    }
}

/// Environment variables (or any name/value pairs standing for them), read
/// with the rules every adapter shares: an empty or blank value counts as unset,
/// an unparsable one is a [`VarError`] naming the variable.
#[derive(Debug, Clone, Default)]
pub struct Vars(BTreeMap<String, String>);

impl Vars {
    /// The process environment.
    pub fn from_env() -> Self {
        Self::new(std::env::vars())
    }

    /// These pairs.
    pub fn new(vars: impl IntoIterator<Item = (impl Into<String>, impl Into<String>)>) -> Self {
        Self(
            vars.into_iter()
                .map(|(var, value)| (var.into(), value.into()))
                .filter(|(_, value): &(String, String)| !value.trim().is_empty())
                .collect(),
        )
    }

    /// The value of `var`, as written.
    pub fn text(&self, var: &str) -> Option<String> {
        self.0.get(var).cloned()
    }

    /// A value parsed with `FromStr` (numbers, `true`/`false`).
    pub fn parse<T>(&self, var: &str) -> Result<Option<T>, VarError>
    where
        T: FromStr,
        T::Err: fmt::Display,
    {
        self.0
            .get(var)
            .map(|value| {
                value.trim().parse().map_err(|e: T::Err| VarError {
                    var: var.to_string(),
                    value: value.clone(),
                    reason: e.to_string(),
                })
            })
            .transpose()
    }

    /// A duration in whole milliseconds (the `*_MS` variables).
    pub fn millis(&self, var: &str) -> Result<Option<HumanDuration>, VarError> {
        Ok(self.parse::<u64>(var)?.map(HumanDuration::millis))
    }

    /// Every variable whose name starts with `prefix`, with the rest of its name.
    pub fn with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = (&'a str, &'a str)> {
        self.0
            .iter()
            .filter_map(move |(var, value)| Some((var.strip_prefix(prefix)?, value.as_str())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_and_name_what_is_wrong() {
        assert_eq!("0".parse(), Ok(HumanDuration(Duration::ZERO)));
        assert_eq!("1h 30m".parse(), Ok(HumanDuration::secs(5400)));
        assert_eq!("250ms".parse(), Ok(HumanDuration::millis(250)));
        let err = "soon".parse::<HumanDuration>().unwrap_err();
        assert!(err.contains("`soon`"), "{err}");
        assert_eq!(HumanDuration::secs(90).to_string(), "1m 30s");
    }

    #[test]
    fn blank_values_are_unset_and_bad_ones_name_the_variable() {
        let vars = Vars::new([
            ("A".to_string(), " ".to_string()),
            ("N".to_string(), "12".to_string()),
            ("BAD".to_string(), "x".to_string()),
            ("P_ONE".to_string(), "1".to_string()),
        ]);
        assert_eq!(vars.text("A"), None);
        assert_eq!(vars.text("N").as_deref(), Some("12"));
        assert_eq!(vars.parse::<u32>("N"), Ok(Some(12)));
        assert_eq!(vars.millis("N"), Ok(Some(HumanDuration::millis(12))));
        assert_eq!(vars.parse::<u32>("MISSING"), Ok(None));
        let err = vars.parse::<bool>("BAD").unwrap_err();
        assert_eq!(err.var, "BAD");
        assert!(
            err.to_string()
                .starts_with("environment variable BAD=`x`: "),
            "{err}"
        );
        assert_eq!(vars.with_prefix("P_").collect::<Vec<_>>(), [("ONE", "1")]);
    }

    env_settings! {
        /// Settings of a test.
        struct TestSettings {
            #[env(ENV_NAME = "TEST_NAME")]
            name: Option<String>,
            #[env(ENV_WAIT_MS = "TEST_WAIT_MS", millis)]
            wait: Option<HumanDuration>,
            #[env(ENV_LIMIT = "TEST_LIMIT")]
            limit: Option<u32>,
            tags: BTreeMap<String, String>,
        }
        type Error = ConfigError;
    }

    #[test]
    fn text_reaches_a_setting_by_its_key_and_names_the_key_when_refused() {
        let s = TestSettings::default()
            .with_config("name", " as written ")
            .and_then(|s| s.with_config("wait", "2s"))
            .and_then(|s| s.with_config("limit", " 8 "))
            .and_then(|s| s.with_config("tags.team.name", "orders"))
            .unwrap();
        assert_eq!(s.name.as_deref(), Some(" as written "));
        assert_eq!(s.wait, Some(HumanDuration::secs(2)));
        assert_eq!(s.limit, Some(8));
        assert_eq!(s.tags.get("team.name").map(String::as_str), Some("orders"));

        let refused =
            |key: &str, value: &str| TestSettings::default().with_config(key, value).unwrap_err();
        let err = refused("colour", "red");
        assert_eq!(err.key, "colour");
        assert!(err.reason.contains("name, wait, limit, tags"), "{err}");
        let err = refused("limit", "-1");
        assert_eq!(err.key, "limit");
        assert!(err.reason.starts_with("`-1`: "), "{err}");
        assert_eq!(refused("wait", "soon").key, "wait");
        assert!(refused("limit.x", "1").reason.contains("no entry `x`"));
        assert!(refused("tags", "x").reason.contains("one entry at a time"));
    }

    #[test]
    fn variables_go_through_the_keys_and_errors_name_the_variable() {
        let s = TestSettings::default()
            .with_config("limit", "3")
            .unwrap()
            .with_vars([
                ("TEST_WAIT_MS", "250"),
                ("TEST_LIMIT", " "),
                ("TEST_NAME", "n"),
            ])
            .unwrap();
        assert_eq!(s.wait, Some(HumanDuration::millis(250)));
        assert_eq!(s.limit, Some(3), "a blank variable is unset");
        assert_eq!(s.name.as_deref(), Some("n"));
        for (var, value) in [("TEST_LIMIT", "many"), ("TEST_WAIT_MS", "2s")] {
            let err = TestSettings::default()
                .with_vars([(var, value)])
                .unwrap_err();
            assert_eq!(err.key, var);
            assert!(err.reason.contains(&format!("`{value}`")), "{err}");
        }
    }

    #[test]
    fn config_errors_name_the_key() {
        let err = ConfigError::from(Vars::new([("N", "x")]).parse::<u32>("N").unwrap_err());
        assert_eq!(err.key, "N");
        assert!(err.to_string().starts_with("N: `x`: "), "{err}");
        let err = ConfigError::from(
            Envelope::from_settings("cloudevents-binary", None, None).unwrap_err(),
        );
        assert_eq!(err.key, "envelope.source");
        assert!(err.reason.contains("OUTBOX_CLOUDEVENTS_SOURCE"), "{err}");
        let err = ConfigError::from(Envelope::from_settings("soap", None, None).unwrap_err());
        assert_eq!(err.key, "envelope.format");
        assert_eq!(ConfigError::new("k", "why").to_string(), "k: why");
    }
}
