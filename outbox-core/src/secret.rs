//! Secrets kept in files (a Kubernetes secret mounted as a file, a Docker secret):
//! read the same way by every crate that accepts a `*_file` setting.

use std::path::{Path, PathBuf};

/// A secret file that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SecretFileError {
    /// The file cannot be read.
    #[error("`{}`: cannot read it: {source}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// The file holds nothing but a line break.
    #[error("`{}` is empty", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
}

/// The secret in `path`: the file's text without its trailing line break (as
/// `echo` and most secret stores write it); other whitespace is kept.
pub fn read_secret_file(path: &Path) -> Result<String, SecretFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| SecretFileError::Unreadable {
        path: path.to_path_buf(),
        source,
    })?;
    let secret = text.trim_end_matches(['\n', '\r']);
    if secret.is_empty() {
        return Err(SecretFileError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(secret.to_string())
}

/// `url` without its password, for messages and logs: `scheme://user:***@host/...`.
/// A comma-separated list of URLs (as NATS accepts) is redacted item by item; a URL
/// without a password is returned unchanged.
pub fn redact_url(url: &str) -> String {
    url.split(',')
        .map(|one| {
            let Some(scheme) = one.find("://") else {
                return one.to_string();
            };
            let rest = &one[scheme + 3..];
            // The userinfo ends at the last `@` before the path.
            let authority = rest.split('/').next().unwrap_or_default();
            match authority.rfind('@') {
                Some(at) if authority[..at].contains(':') => {
                    let user = authority[..at].split(':').next().unwrap_or_default();
                    format!("{}{user}:***{}", &one[..scheme + 3], &rest[at..])
                }
                _ => one.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailing_line_breaks_go_and_empty_or_missing_files_are_named() {
        let dir = std::env::temp_dir().join(format!("outbox-secret-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("secret");
        std::fs::write(&file, " pass word \r\n").expect("write");
        assert_eq!(read_secret_file(&file).expect("read"), " pass word ");
        std::fs::write(&file, "\n").expect("write");
        let empty = read_secret_file(&file).expect_err("empty");
        assert!(empty.to_string().ends_with("is empty"), "{empty}");
        let missing = read_secret_file(&dir.join("missing")).expect_err("missing");
        assert!(missing.to_string().contains("cannot read it"), "{missing}");
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn passwords_are_redacted_from_urls_and_url_lists() {
        assert_eq!(
            redact_url("amqps://app:s3cr@t@mq.example:5671/%2f"),
            "amqps://app:***@mq.example:5671/%2f"
        );
        assert_eq!(
            redact_url("nats://a:pw1@n1:4222,nats://n2:4222,tls://b:pw2@n3"),
            "nats://a:***@n1:4222,nats://n2:4222,tls://b:***@n3"
        );
        assert_eq!(
            redact_url("postgres://app@db/orders?sslmode=require"),
            "postgres://app@db/orders?sslmode=require"
        );
        assert_eq!(redact_url("nats://token@host"), "nats://token@host");
        assert_eq!(redact_url("127.0.0.1:4222"), "127.0.0.1:4222");
        // An `@` in the path is not userinfo.
        assert_eq!(redact_url("http://h/a:b@c"), "http://h/a:b@c");
    }
}
