//! The process-wide rustls crypto provider.

/// rustls needs one process-wide crypto provider when more than one is compiled into
/// the binary (ring, which this crate's broker client uses, and aws-lc-rs, which
/// the AWS SDK brings when SQS is in the same binary); the client builds its TLS
/// configuration from that default, and the first TLS handshake panics without
/// one. Installs ring's, unless the process already chose a provider.
pub(crate) fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race with another installer is fine: a provider is then set.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}
