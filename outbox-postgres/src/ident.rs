//! SQL identifiers (schema, table, index names): validated once, then quoted.
//!
//! Every name that reaches SQL text goes through [`Ident::new`]; nothing a user
//! configures is spliced raw.

use std::fmt;

use crate::error::Error;

/// PostgreSQL's identifier limit (NAMEDATALEN - 1).
pub(crate) const MAX_IDENT_LEN: usize = 63;

/// A validated identifier: lower-case ASCII letters, digits and `_`, starting
/// with a letter or `_`, at most 63 bytes.
///
/// Lower case only, so the quoted name is the name `psql` users type unquoted.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Ident(String);

impl Ident {
    /// Validate `value` as the name of `what` (used in the error message).
    pub fn new(what: &'static str, value: &str) -> Result<Self, Error> {
        let reason = if value.is_empty() {
            Some("it is empty".to_string())
        } else if value.len() > MAX_IDENT_LEN {
            Some(format!(
                "it is {} bytes long; the limit is {MAX_IDENT_LEN}",
                value.len()
            ))
        } else if value.starts_with(|c: char| c.is_ascii_digit()) {
            Some("it starts with a digit".to_string())
        } else {
            value
                .chars()
                .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_'))
                .map(|c| format!("{c:?} is not allowed (use lower-case letters, digits and '_')"))
        };
        match reason {
            Some(reason) => Err(Error::InvalidIdentifier {
                what,
                value: value.to_string(),
                reason,
            }),
            None => Ok(Self(value.to_string())),
        }
    }

    /// The name as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name quoted for SQL text.
    pub fn quoted(&self) -> String {
        // Validation allows no '"', so no escaping is needed.
        format!("\"{}\"", self.0)
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_names() {
        assert_eq!(
            Ident::new("table", "outbox_events").unwrap().quoted(),
            "\"outbox_events\""
        );
        assert!(Ident::new("table", "_t1").is_ok());
    }

    #[test]
    fn rejects_injection_and_odd_names() {
        for bad in [
            "",
            "1abc",
            "Outbox",
            "a-b",
            "a\"b",
            "x; drop table y",
            "é",
            &"a".repeat(64),
        ] {
            let err = Ident::new("table", bad).unwrap_err();
            assert!(err.to_string().contains("invalid table name"), "{err}");
        }
    }
}
