//! A nats-server of a test's own with a TLS listener (feature `test-utils`), for
//! TLS tests of this crate and of crates built on it (the `outbox` binary's), and
//! the address of the NATS server the tests run against.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// User of the password account of [`TlsNatsServer`].
pub const USER: &str = "outbox";
/// Its password.
pub const PASSWORD: &str = "s3cret with spaces";

/// A nats-server with only a TLS listener (the given certificate) on a free port of
/// 127.0.0.1, JetStream in a temporary folder, one nkey user and one user with a
/// password ([`USER`], [`PASSWORD`]); killed when dropped.
pub struct TlsNatsServer {
    child: Child,
    url: String,
    dir: tempfile::TempDir,
    seed_file: PathBuf,
}

/// Whether a NATS server on `port` greets a new client with `INFO` (sent in clear
/// before any TLS handshake).
fn greets(port: u16) -> bool {
    use std::io::Read;
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let mut greeting = [0u8; 4];
    stream.read_exact(&mut greeting).is_ok() && &greeting == b"INFO"
}

impl TlsNatsServer {
    /// Start it with this server certificate and key (PEM files) and wait until it
    /// listens. Panics with the reason when it cannot (a test helper).
    pub fn start(cert: &Path, key: &Path) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let user = nkeys::KeyPair::new_user();
        let seed_file = dir.path().join("user.nk");
        std::fs::write(&seed_file, format!("{}\n", user.seed().expect("seed"))).expect("seed");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let config = dir.path().join("nats.conf");
        std::fs::write(
            &config,
            format!(
                r#"listen: "127.0.0.1:{port}"
jetstream {{ store_dir: "{store}" }}
tls {{ cert_file: "{cert}", key_file: "{key}", timeout: 5 }}
authorization {{ users = [ {{ nkey: "{nkey}" }}, {{ user: "{USER}", password: "{PASSWORD}" }} ] }}
"#,
                store = dir.path().join("js").display(),
                cert = cert.display(),
                key = key.display(),
                nkey = user.public_key(),
            ),
        )
        .expect("write nats.conf");
        let child = Command::new(nats_server())
            .arg("-c")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server");
        let server = Self {
            child,
            url: format!("tls://127.0.0.1:{port}"),
            dir,
            seed_file,
        };
        // Listening is not serving: a connection made while the server still starts
        // up can be reset. Ready is when it greets a client with its INFO line.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !greets(port) {
            assert!(
                Instant::now() < deadline,
                "nats-server did not answer on {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    /// Its URL, `tls://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A file holding the seed of its nkey user.
    pub fn nkey_seed_file(&self) -> &Path {
        &self.seed_file
    }

    /// A temporary folder that lives as long as the server, for a test's files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for TlsNatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nats_server() -> PathBuf {
    [
        "/usr/sbin/nats-server",
        "/usr/bin/nats-server",
        "/usr/local/bin/nats-server",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.is_file())
    .expect("nats-server is installed (Debian package nats-server)")
}

/// The NATS server (with JetStream) the tests run against: `OUTBOX_NATS_URL`, as
/// scripts/test.sh exports it and the `outbox` binary reads it, or the local one.
pub fn nats_url() -> String {
    std::env::var("OUTBOX_NATS_URL").unwrap_or_else(|_| crate::DEFAULT_URL.into())
}
