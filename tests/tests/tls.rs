//! TLS on both ports (issue #11): a CA, a server and a client certificate made
//! here (rcgen); HTTPS and gRPC over TLS from Rust (rustls), mutual TLS refusing a
//! client without a certificate, and NVIDIA's tritonclient with `ssl=True` over
//! HTTP and gRPC (`tests/tritonclient-tls`, pytest).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use kiln_tests::Kiln;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tonic::codegen::http;

/// A CA, a server certificate for `localhost` and 127.0.0.1, and a client
/// certificate, as PEM files in a folder removed on drop.
struct Certificates {
    dir: PathBuf,
}

impl Certificates {
    fn new(name: &str) -> Certificates {
        let dir = std::env::temp_dir().join(format!("kiln-tls-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "kiln test CA");
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_key = KeyPair::generate().unwrap();
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let leaf = |names: Vec<String>, usage: ExtendedKeyUsagePurpose, file: &str| {
            let mut params = CertificateParams::new(names).unwrap();
            params.distinguished_name.push(DnType::CommonName, file);
            params.extended_key_usages = vec![usage];
            let key = KeyPair::generate().unwrap();
            let cert = params.signed_by(&key, &ca_cert, &ca_key).unwrap();
            std::fs::write(dir.join(format!("{file}.pem")), cert.pem()).unwrap();
            std::fs::write(dir.join(format!("{file}.key")), key.serialize_pem()).unwrap();
        };
        leaf(
            vec!["localhost".into(), "127.0.0.1".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
            "server",
        );
        leaf(
            vec!["client".into()],
            ExtendedKeyUsagePurpose::ClientAuth,
            "client",
        );
        std::fs::write(dir.join("ca.pem"), ca_cert.pem()).unwrap();
        Certificates { dir }
    }

    fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }

    /// kiln's flags for TLS (and, with `mutual`, client certificates).
    fn args(&self, mutual: bool) -> Vec<String> {
        let mut args = vec![
            "--tls-cert".into(),
            self.path("server.pem"),
            "--tls-key".into(),
            self.path("server.key"),
        ];
        if mutual {
            args.extend(["--tls-client-ca".into(), self.path("ca.pem")]);
        }
        args
    }

    /// A rustls client trusting the CA, with the client certificate when `cert`.
    fn client(&self, alpn: &[u8], cert: bool) -> tokio_rustls::TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_file(self.dir.join("ca.pem")).unwrap())
            .unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
        let mut config = if cert {
            let chain = vec![CertificateDer::from_pem_file(self.dir.join("client.pem")).unwrap()];
            let key = PrivateKeyDer::from_pem_file(self.dir.join("client.key")).unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        } else {
            builder.with_no_client_auth()
        };
        config.alpn_protocols = vec![alpn.to_vec()];
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }
}

impl Drop for Certificates {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn host_port(url: &str) -> &str {
    url.trim_start_matches("http://")
}

fn start(certs: &Certificates, mutual: bool) -> Kiln {
    let mut args = certs.args(mutual);
    args.extend(["--load".into(), "echo".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Kiln::start(&args)
}

async fn tls_connect(
    connector: &tokio_rustls::TlsConnector,
    addr: &str,
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").unwrap();
    connector.connect(name, tcp).await
}

/// `GET /v2/health/ready` over HTTPS; the whole answer, or the error.
async fn https_ready(certs: &Certificates, kiln: &Kiln, cert: bool) -> std::io::Result<String> {
    let mut tls = tls_connect(&certs.client(b"http/1.1", cert), host_port(&kiln.url)).await?;
    tls.write_all(b"GET /v2/health/ready HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await?;
    let mut answer = Vec::new();
    tls.read_to_end(&mut answer).await?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

/// A `ServerLive` call over gRPC with TLS; its message, or the error.
async fn grpc_live(certs: &Certificates, kiln: &Kiln) -> Bytes {
    let tls = tls_connect(&certs.client(b"h2", false), host_port(&kiln.grpc_url))
        .await
        .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (send, connection) = h2::client::handshake(tls).await.unwrap();
    tokio::spawn(connection);
    let mut send = send.ready().await.unwrap();
    let request =
        http::Request::post("https://localhost/inference.GRPCInferenceService/ServerLive")
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
    let (response, mut body) = send.send_request(request, false).unwrap();
    body.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true)
        .unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut message = Vec::new();
    while let Some(data) = body.data().await {
        message.extend_from_slice(&data.unwrap());
    }
    let trailers = body.trailers().await.unwrap().unwrap();
    assert_eq!(trailers.get("grpc-status").unwrap(), "0");
    Bytes::from(message)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_and_grpc_over_tls() {
    let certs = Certificates::new("plain");
    let kiln = start(&certs, false);
    let answer = https_ready(&certs, &kiln, false).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // ServerLiveResponse { live: true }, length-prefixed.
    assert_eq!(&grpc_live(&certs, &kiln).await[..], &[0, 0, 0, 0, 2, 8, 1]);
    // A plain-text client gets no answer from the TLS ports.
    let mut plain = TcpStream::connect(host_port(&kiln.url)).await.unwrap();
    plain
        .write_all(b"GET /v2/health/ready HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = plain.read_to_end(&mut answer).await;
    assert!(!answer.starts_with(b"HTTP/1.1 200"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_tls_handshake_never_finished_is_dropped() {
    let certs = Certificates::new("stalled");
    let mut args = certs.args(false);
    args.extend(["--grpc-handshake-timeout".into(), "1".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let kiln = Kiln::start(&args);
    // Connected, and then silent: no ClientHello.
    let mut silent = TcpStream::connect(host_port(&kiln.grpc_url)).await.unwrap();
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(std::time::Duration::from_secs(30), silent.read(&mut buf))
        .await
        .expect("the silent connection is still open");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_a_client_without_a_certificate() {
    let certs = Certificates::new("mutual");
    let kiln = start(&certs, true);
    let answer = https_ready(&certs, &kiln, true).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let refused = https_ready(&certs, &kiln, false).await;
    assert!(
        refused.as_ref().map_or(true, |a| a.is_empty()),
        "answered without a client certificate: {refused:?}"
    );
}

#[test]
fn tritonclient_over_tls() {
    let certs = Certificates::new("tritonclient");
    let kiln = start(&certs, false);
    let ca = certs.path("ca.pem");
    kiln_tests::pytest::run_pytest(
        &kiln,
        "tests/tritonclient-tls",
        &[("KILN_TLS_CA", ca.as_ref())],
    );
}
