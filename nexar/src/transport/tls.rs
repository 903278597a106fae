//! Certificates and TLS configuration: the cluster CA, per-rank identities, and the rustls
//! verifiers used between workers (mutual TLS, rank-bound names) and towards the seed (the CA
//! pinned by the join token's fingerprint).

use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use sha2::{Digest, Sha256};

use super::TransportError;
use crate::config::DEFAULT_CERT_LIFETIME;

/// TLS server name the seed's certificate carries.
pub const SEED_SERVER_NAME: &str = "seed.nexar";
/// ALPN protocol spoken between workers.
pub const MESH_ALPN: &[u8] = b"nexar/1";
/// ALPN protocol spoken with the seed.
pub const SEED_ALPN: &[u8] = b"nexar-seed/1";

/// The TLS server name bound to `rank` in its certificate.
pub fn rank_server_name(rank: u32) -> String {
    format!("rank-{rank}.nexar")
}

/// A key's pin: SHA-256 of the public key a certificate (or a signing request) carries. The
/// seed lists each rank's pin in the peer table, so that only the holder of the key the seed
/// certified for a rank is admitted as that rank, even by a peer that also holds an older,
/// still valid certificate for the same rank (a worker that left before the cluster formed).
pub type KeyPin = [u8; 32];

/// The pin of the key in a certificate (DER).
pub fn key_pin(cert_der: &[u8]) -> Result<KeyPin, TransportError> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der)
        .map_err(|e| TransportError::Tls(format!("unparsable certificate: {e}")))?;
    Ok(fingerprint(&cert.public_key().subject_public_key.data))
}

/// The pin of the key in a certificate signing request (DER): equal to [`key_pin`] of the
/// certificate signed from it.
pub fn key_pin_of_request(csr_der: &[u8]) -> Result<KeyPin, TransportError> {
    use x509_parser::prelude::FromDer;
    let (_, csr) = x509_parser::certification_request::X509CertificationRequest::from_der(csr_der)
        .map_err(|e| TransportError::Tls(format!("unparsable certificate signing request: {e}")))?;
    Ok(fingerprint(&csr.certification_request_info.subject_pki.subject_public_key.data))
}

/// The rank a certificate is bound to, read from its subject alternative name.
pub fn rank_from_cert(der: &[u8]) -> Result<u32, TransportError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| TransportError::Tls(format!("unparsable peer certificate: {e}")))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| TransportError::Tls(format!("bad subject alternative name: {e}")))?
        .ok_or_else(|| TransportError::Tls("peer certificate names no rank".into()))?;
    san.value
        .general_names
        .iter()
        .find_map(|name| match name {
            x509_parser::extensions::GeneralName::DNSName(dns) => dns
                .strip_prefix("rank-")
                .and_then(|rest| rest.strip_suffix(".nexar"))
                .and_then(|n| n.parse::<u32>().ok()),
            _ => None,
        })
        .ok_or_else(|| TransportError::Tls("peer certificate names no rank".into()))
}

/// SHA-256 of a certificate, as carried in join tokens.
pub fn fingerprint(der: &[u8]) -> [u8; 32] {
    Sha256::digest(der).into()
}

/// The crypto provider nexar uses everywhere: aws-lc-rs, AES-128-GCM preferred. On CPUs with
/// VAES and AVX-512 its AES-GCM runs about twice as fast as ring's (27 against 12 GB/s sealing
/// 256 KiB records on these machines), and AES-GCM is the largest cost of a large collective.
pub fn provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::aws_lc_rs::default_provider();
    p.cipher_suites.sort_by_key(|s| match s.suite() {
        rustls::CipherSuite::TLS13_AES_128_GCM_SHA256 => 0,
        rustls::CipherSuite::TLS13_AES_256_GCM_SHA384 => 1,
        _ => 2,
    });
    Arc::new(p)
}

fn tls_err(context: &str) -> impl Fn(rcgen::Error) -> TransportError + '_ {
    move |e| TransportError::Tls(format!("{context}: {e}"))
}

/// A certificate chain with its private key. The key never leaves the process that made it.
pub struct Identity {
    chain: Vec<CertificateDer<'static>>,
    key: PrivatePkcs8KeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Identity { chain: self.chain.clone(), key: self.key.clone_key() }
    }
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity").field("chain_len", &self.chain.len()).finish_non_exhaustive()
    }
}

impl Identity {
    /// An identity from DER: the certificate chain (leaf first, then the CA) and the leaf's
    /// PKCS#8 private key.
    pub fn from_der(chain: Vec<Vec<u8>>, pkcs8_key: Vec<u8>) -> Result<Identity, TransportError> {
        if chain.is_empty() {
            return Err(TransportError::Tls("an identity needs at least its own certificate".into()));
        }
        Ok(Identity {
            chain: chain.into_iter().map(CertificateDer::from).collect(),
            key: PrivatePkcs8KeyDer::from(pkcs8_key),
        })
    }

    fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(self.key.clone_key())
    }

    /// The leaf certificate (DER).
    pub fn cert(&self) -> &[u8] {
        &self.chain[0]
    }
}

/// A freshly generated key pair waiting for its certificate.
pub struct PendingIdentity {
    key: KeyPair,
}

impl PendingIdentity {
    /// Generates a key and a certificate signing request for it.
    pub fn generate() -> Result<(Self, Vec<u8>), TransportError> {
        let key = KeyPair::generate().map_err(tls_err("generating a key"))?;
        let params = CertificateParams::new(Vec::<String>::new()).map_err(tls_err("csr params"))?;
        let csr = params.serialize_request(&key).map_err(tls_err("building the csr"))?;
        Ok((PendingIdentity { key }, csr.der().to_vec()))
    }

    /// Combines the key with the certificate the seed signed for it.
    pub fn complete(self, cert_der: Vec<u8>, ca_der: Vec<u8>) -> Identity {
        Identity {
            chain: vec![CertificateDer::from(cert_der), CertificateDer::from(ca_der)],
            key: PrivatePkcs8KeyDer::from(self.key.serialize_der()),
        }
    }
}

/// The cluster's certificate authority. Lives in the seed (or in memory for a local cluster).
pub struct ClusterCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    /// When the CA and every certificate it issues stop being valid.
    not_after: time::OffsetDateTime,
}

/// How far back certificates are valid from, for clocks a little behind the seed's.
const CLOCK_SKEW: time::Duration = time::Duration::hours(1);

impl ClusterCa {
    /// Generates a new CA with a fresh key, valid for [`DEFAULT_CERT_LIFETIME`].
    pub fn generate() -> Result<Self, TransportError> {
        Self::generate_valid_for(DEFAULT_CERT_LIFETIME)
    }

    /// Generates a new CA with a fresh key; it and every certificate it issues are valid for
    /// `lifetime` from now (an hour earlier too, for clocks behind this one's), not for
    /// centuries: a key that leaks outlives its use by at most that.
    pub fn generate_valid_for(lifetime: std::time::Duration) -> Result<Self, TransportError> {
        let now = time::OffsetDateTime::now_utc();
        let lifetime = time::Duration::try_from(lifetime)
            .map_err(|e| TransportError::Tls(format!("certificate lifetime {lifetime:?}: {e}")))?;
        let not_after = now
            .checked_add(lifetime)
            .ok_or_else(|| TransportError::Tls(format!("certificate lifetime {lifetime} runs past the calendar")))?;
        let key = KeyPair::generate().map_err(tls_err("generating the ca key"))?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(tls_err("ca params"))?;
        (params.not_before, params.not_after) = (now - CLOCK_SKEW, not_after);
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "nexar cluster ca");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let issuer = CertifiedIssuer::self_signed(params, key).map_err(tls_err("self-signing the ca"))?;
        Ok(ClusterCa { issuer, not_after })
    }

    /// When the CA and the certificates it issued stop being valid.
    pub fn expires_at(&self) -> std::time::SystemTime {
        self.not_after.into()
    }

    /// The CA certificate (DER).
    pub fn cert_der(&self) -> &[u8] {
        self.issuer.der()
    }

    /// The CA certificate as rustls takes it.
    pub(crate) fn certificate(&self) -> CertificateDer<'static> {
        self.issuer.der().clone()
    }

    /// SHA-256 of the CA certificate.
    pub fn fingerprint(&self) -> [u8; 32] {
        fingerprint(self.issuer.der())
    }

    fn leaf_params(&self, name: &str) -> Result<CertificateParams, TransportError> {
        let mut params = CertificateParams::new(vec![name.to_string()]).map_err(tls_err("leaf params"))?;
        (params.not_before, params.not_after) = (time::OffsetDateTime::now_utc() - CLOCK_SKEW, self.not_after);
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.subject_alt_names = vec![SanType::DnsName(name.try_into().map_err(tls_err("leaf name"))?)];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        Ok(params)
    }

    /// Signs a worker's request with a certificate bound to `rank`. Only the request's public
    /// key is used: names and extensions it asks for are ignored.
    pub fn sign_csr(&self, csr_der: &[u8], rank: u32) -> Result<Vec<u8>, TransportError> {
        let csr = CertificateSigningRequestParams::from_der(&csr_der.to_vec().into())
            .map_err(tls_err("invalid certificate signing request"))?;
        let params = self.leaf_params(&rank_server_name(rank))?;
        let cert = params.signed_by(&csr.public_key, &self.issuer).map_err(tls_err("signing"))?;
        Ok(cert.der().to_vec())
    }

    /// Generates a key and a certificate for `name` in this process (the seed's own identity,
    /// and the ranks of an in-process cluster).
    pub fn issue(&self, name: &str) -> Result<Identity, TransportError> {
        let key = KeyPair::generate().map_err(tls_err("generating a key"))?;
        let cert = self.leaf_params(name)?.signed_by(&key, &self.issuer).map_err(tls_err("signing"))?;
        Ok(Identity {
            chain: vec![cert.der().clone(), self.issuer.der().clone()],
            key: PrivatePkcs8KeyDer::from(key.serialize_der()),
        })
    }
}

fn roots(ca_der: &CertificateDer<'static>) -> Result<Arc<RootCertStore>, TransportError> {
    let mut roots = RootCertStore::empty();
    roots.add(ca_der.clone()).map_err(|e| TransportError::Tls(format!("bad ca certificate: {e}")))?;
    Ok(Arc::new(roots))
}

fn rustls_err(context: &'static str) -> impl Fn(rustls::Error) -> TransportError {
    move |e| TransportError::Tls(format!("{context}: {e}"))
}

fn quic_server(tls: rustls::ServerConfig) -> Result<quinn::ServerConfig, TransportError> {
    let crypto = QuicServerConfig::try_from(tls).map_err(|e| TransportError::Tls(e.to_string()))?;
    Ok(quinn::ServerConfig::with_crypto(Arc::new(crypto)))
}

fn quic_client(tls: rustls::ClientConfig) -> Result<quinn::ClientConfig, TransportError> {
    let crypto = QuicClientConfig::try_from(tls).map_err(|e| TransportError::Tls(e.to_string()))?;
    Ok(quinn::ClientConfig::new(Arc::new(crypto)))
}

/// Server side of worker-to-worker connections: presents the rank's certificate and requires
/// a client certificate from the same CA.
pub fn mesh_server(identity: &Identity, ca_der: &[u8]) -> Result<quinn::ServerConfig, TransportError> {
    quic_server(mesh_server_tls(identity, &CertificateDer::from(ca_der.to_vec()), MESH_ALPN)?)
}

/// The rustls side of [`mesh_server`], speaking `alpn` (also used by the TCP bulk lane).
pub(crate) fn mesh_server_tls(
    identity: &Identity,
    ca_der: &CertificateDer<'static>,
    alpn: &[u8],
) -> Result<rustls::ServerConfig, TransportError> {
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(ca_der)?, provider())
        .build()
        .map_err(|e| TransportError::Tls(format!("client verifier: {e}")))?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(rustls_err("tls versions"))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(identity.chain.clone(), identity.key())
        .map_err(rustls_err("server certificate"))?;
    tls.alpn_protocols = vec![alpn.to_vec()];
    Ok(tls)
}

/// Client side of worker-to-worker connections: trusts only the cluster CA (the dialled rank's
/// name is checked by the server-name match) and presents the rank's own certificate.
pub fn mesh_client(identity: &Identity, ca_der: &[u8]) -> Result<quinn::ClientConfig, TransportError> {
    quic_client(mesh_client_tls(identity, &CertificateDer::from(ca_der.to_vec()), MESH_ALPN)?)
}

/// The rustls side of [`mesh_client`], speaking `alpn` (also used by the TCP bulk lane).
pub(crate) fn mesh_client_tls(
    identity: &Identity,
    ca_der: &CertificateDer<'static>,
    alpn: &[u8],
) -> Result<rustls::ClientConfig, TransportError> {
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(rustls_err("tls versions"))?
        .with_root_certificates(roots(ca_der)?)
        .with_client_auth_cert(identity.chain.clone(), identity.key())
        .map_err(rustls_err("client certificate"))?;
    tls.alpn_protocols = vec![alpn.to_vec()];
    Ok(tls)
}

/// The seed's server configuration: no client certificate (workers have none yet); workers
/// prove themselves with the token's secret inside the encrypted connection.
pub fn seed_server(identity: &Identity) -> Result<quinn::ServerConfig, TransportError> {
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(rustls_err("tls versions"))?
        .with_no_client_auth()
        .with_single_cert(identity.chain.clone(), identity.key())
        .map_err(rustls_err("seed certificate"))?;
    tls.alpn_protocols = vec![SEED_ALPN.to_vec()];
    quic_server(tls)
}

/// A worker's configuration for dialling the seed. With a join token's fingerprint, the seed
/// must present a chain whose CA has it. With `None` (a job authenticated by a shared secret),
/// the seed's certificate must chain to the CA it presents, and the worker trusts that CA only
/// once the seed has proved, on this very session, that it knows the secret.
pub fn seed_client(ca_fingerprint: Option<[u8; 32]>) -> Result<quinn::ClientConfig, TransportError> {
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(rustls_err("tls versions"))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedCaVerifier { ca_fingerprint, provider: provider() }))
        .with_no_client_auth();
    tls.alpn_protocols = vec![SEED_ALPN.to_vec()];
    quic_client(tls)
}

/// Why a worker refuses a seed whose CA is not the one its token names.
pub(crate) const FOREIGN_SEED: &str = "the seed's certificate is not from the CA named in the join token";

/// Verifies the seed against the CA fingerprint carried in the join token (kubeadm's
/// discovery-token-ca-cert-hash, for QUIC), or, with no fingerprint, against the CA the seed
/// presents (the shared secret's proof then authenticates the session).
#[derive(Debug)]
struct PinnedCaVerifier {
    ca_fingerprint: Option<[u8; 32]>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedCaVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let ca = match self.ca_fingerprint {
            Some(pin) => intermediates
                .iter()
                .find(|c| fingerprint(c) == pin)
                .ok_or_else(|| rustls::Error::General(FOREIGN_SEED.into()))?,
            None => intermediates
                .last()
                .ok_or_else(|| rustls::Error::General("the seed presented no CA certificate".into()))?,
        };
        let ca = CertificateDer::from(ca.to_vec());
        let roots = roots(&ca).map_err(|e| rustls::Error::General(e.to_string()))?;
        let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(roots, self.provider.clone())
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        inner.verify_server_cert(end_entity, &[], server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_expires_after_its_lifetime() {
        use std::time::{Duration, SystemTime};
        let ca = crate::transport::tls::ClusterCa::generate_valid_for(Duration::from_secs(3600)).unwrap();
        assert!(ca.expires_at() > SystemTime::now() && ca.expires_at() < SystemTime::now() + Duration::from_secs(3601));
    }

    #[test]
    fn two_keys_have_two_pins() {
        use crate::transport::tls::{ClusterCa, key_pin};
        let ca = ClusterCa::generate().unwrap();
        let (a, b) = (ca.issue("rank-0.nexar").unwrap(), ca.issue("rank-0.nexar").unwrap());
        assert_ne!(key_pin(a.cert()).unwrap(), key_pin(b.cert()).unwrap(), "two keys, two pins");
    }

    #[test]
    fn signed_requests_are_bound_to_the_rank_not_to_what_they_ask() {
        let ca = ClusterCa::generate().unwrap();
        let (_pending, csr) = PendingIdentity::generate().unwrap();
        let cert = ca.sign_csr(&csr, 3).unwrap();
        assert_eq!(rank_from_cert(&cert).unwrap(), 3);
        let id = ca.issue(&rank_server_name(11)).unwrap();
        assert_eq!(rank_from_cert(id.cert()).unwrap(), 11);
        assert!(ca.sign_csr(b"junk", 1).is_err());
        let seed = ca.issue(SEED_SERVER_NAME).unwrap();
        assert!(rank_from_cert(seed.cert()).is_err());
    }

    #[test]
    fn certificates_are_valid_for_the_configured_lifetime_not_for_centuries() {
        let lifetime = std::time::Duration::from_secs(48 * 3600);
        let ca = ClusterCa::generate_valid_for(lifetime).unwrap();
        let (_pending, csr) = PendingIdentity::generate().unwrap();
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        for der in
            [ca.cert_der().to_vec(), ca.sign_csr(&csr, 0).unwrap(), ca.issue(SEED_SERVER_NAME).unwrap().cert().to_vec()]
        {
            let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
            let (from, to) = (cert.validity().not_before.timestamp(), cert.validity().not_after.timestamp());
            assert!(from <= now && from >= now - 3700, "valid from {from}, now {now}");
            assert!((to - now - 48 * 3600).abs() <= 5, "valid until {to}, now {now}");
        }
        assert!(ClusterCa::generate_valid_for(std::time::Duration::from_secs(u64::MAX)).is_err());
    }
}
