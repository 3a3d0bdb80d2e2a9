package identity

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"github.com/redirector-mesh/redirector/internal/smallfile"
)

// File names inside a CA directory.
const (
	RootKeyFile  = "root-key.pem"
	RootCertFile = "root-cert.pem"
)

const (
	rootValidity = 10 * 365 * 24 * time.Hour
	// backdate is how far NotBefore is set in the past, so that a peer whose
	// clock runs a little behind ours still accepts a certificate we just
	// minted.
	backdate = 2 * time.Minute
)

// CA is a signing key and certificate on disk that mints workload
// certificates locally: a self-signed root (InitCA's layout), or an
// intermediate under the mesh roots (Istio's cacerts layout). Whoever can
// read its key can mint any identity, so it is for standalone use (demo,
// tests, one-node trials); in a cluster istiod signs (package istioca).
type CA struct {
	cert        *x509.Certificate // signs workload certificates
	key         crypto.Signer
	chain       [][]byte // presented after the leaf, below the roots
	trustDomain string
	roots       *x509.CertPool
	rootCerts   []*x509.Certificate
	dir         string
	keyPath     string
	keyMode     fs.FileMode // permission bits of keyPath when loaded
}

// ExposedKey reports the signing key's file and mode when its mode lets
// group or others read or write it: whoever can read that file can sign any
// identity of the mesh. A Secret volume's default mode (0644) and Istio's
// cacerts mounted as it comes do; the chart mounts the key 0400.
func (ca *CA) ExposedKey() (path string, mode fs.FileMode, exposed bool) {
	return ca.keyPath, ca.keyMode, ca.keyMode&0o066 != 0
}

// InitCA creates a new CA in dir for trustDomain: an ECDSA P-256 key in
// dir/root-key.pem (mode 0600) and a self-signed certificate valid for ten
// years in dir/root-cert.pem. It refuses to touch a directory that already
// holds either file, because replacing a root silently breaks every
// certificate the mesh trusts.
func InitCA(dir, trustDomain string) error {
	if err := ValidateTrustDomain(trustDomain); err != nil {
		return fmt.Errorf("init ca: %w", err)
	}
	keyPath := filepath.Join(dir, RootKeyFile)
	certPath := filepath.Join(dir, RootCertFile)
	for _, p := range []string{keyPath, certPath} {
		if _, err := os.Lstat(p); err == nil {
			return fmt.Errorf("init ca: %w: %s is present; remove the directory's CA files to start over", ErrCAExists, p)
		} else if !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("init ca: %w", err)
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("init ca: %w", err)
	}

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("init ca: generate key: %w", err)
	}
	serial, err := randomSerial()
	if err != nil {
		return fmt.Errorf("init ca: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{Organization: []string{trustDomain}},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(rootValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
		URIs:                  []*url.URL{{Scheme: "spiffe", Host: trustDomain}},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return fmt.Errorf("init ca: create certificate: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return fmt.Errorf("init ca: marshal key: %w", err)
	}

	// Key first: if writing the certificate fails we remove the key, so a
	// half-made CA never blocks a retry.
	if err := writeNew(keyPath, 0o600, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})); err != nil {
		return fmt.Errorf("init ca: %w", err)
	}
	if err := writeNew(certPath, 0o644, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})); err != nil {
		_ = os.Remove(keyPath)
		return fmt.Errorf("init ca: %w", err)
	}
	return nil
}

// writeNew writes data to a file that must not exist yet (O_EXCL), so two
// concurrent InitCA calls cannot overwrite each other.
func writeNew(path string, mode os.FileMode, data []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("%w: %s is present", ErrCAExists, path)
		}
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		os.Remove(path)
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		os.Remove(path)
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// File names of Istio's plug-in CA layout (the cacerts Secret): an
// intermediate's certificate and key that sign workload certificates, the
// chain presented after the leaf, and the mesh roots.
const (
	IstioCACertFile    = "ca-cert.pem"
	IstioCAKeyFile     = "ca-key.pem"
	IstioCertChainFile = "cert-chain.pem"
	IstioRootCertFile  = "root-cert.pem"
)

// LoadCA reads a CA from dir, deducing the trust domain from its
// certificates. See LoadCAFor.
func LoadCA(dir string) (*CA, error) { return LoadCAFor(dir, "") }

// LoadCAFor reads a CA from dir in one of two layouts:
//
//   - redirector's (InitCA): root-key.pem and root-cert.pem, the root signs
//     workload certificates directly;
//   - Istio's plug-in CA (cacerts): ca-cert.pem and ca-key.pem sign,
//     cert-chain.pem (ca-cert.pem up to the root; ca-cert.pem alone if
//     absent) follows the leaf, root-cert.pem holds the roots (several
//     during a root rotation). Keys may be RSA or ECDSA.
//
// The Istio layout is chosen when ca-key.pem exists. trustDomain, if not
// empty, is the mesh's; otherwise it comes from a spiffe:// URI SAN of the
// signing certificate or a root, or from the root's Organization (Istio's
// self-signed root names it there). Every error names the file at fault.
func LoadCAFor(dir, trustDomain string) (*CA, error) {
	if _, err := os.Stat(filepath.Join(dir, IstioCAKeyFile)); err == nil {
		ca, err := loadIstioCA(dir, trustDomain)
		if err != nil {
			return nil, fmt.Errorf("load istio plug-in ca: %w", err)
		}
		return ca, nil
	}
	keyPath := filepath.Join(dir, RootKeyFile)
	certPath := filepath.Join(dir, RootCertFile)

	certDER, err := readPEM(certPath, "CERTIFICATE")
	if err != nil {
		return nil, fmt.Errorf("load ca: %w (neither %s nor Istio's %s found)", err, RootKeyFile, IstioCAKeyFile)
	}
	cert, err := x509.ParseCertificate(certDER)
	if err != nil {
		return nil, fmt.Errorf("load ca: parse certificate %s: %w", certPath, err)
	}
	if err := checkSigningCert(cert, certPath); err != nil {
		return nil, fmt.Errorf("load ca: %w", err)
	}
	td, err := pickTrustDomain(trustDomain, cert, []*x509.Certificate{cert})
	if err != nil {
		return nil, fmt.Errorf("load ca: %s: %w", certPath, err)
	}
	key, err := loadKey(keyPath, cert, certPath)
	if err != nil {
		return nil, fmt.Errorf("load ca: %w", err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(cert)
	ca := &CA{cert: cert, key: key, trustDomain: td, roots: roots, rootCerts: []*x509.Certificate{cert}, dir: dir}
	if err := ca.noteKeyMode(keyPath); err != nil {
		return nil, fmt.Errorf("load ca: %w", err)
	}
	if err := ca.selfCheck(); err != nil {
		return nil, fmt.Errorf("load ca: %w", err)
	}
	return ca, nil
}

// noteKeyMode records the mode of the key file the CA was read from, the
// file a symlink names (a Secret volume's files are symlinks).
func (ca *CA) noteKeyMode(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("stat key %s: %w", path, err)
	}
	ca.keyPath, ca.keyMode = path, fi.Mode().Perm()
	return nil
}

// selfCheck signs a certificate for a stand-in identity and checks it as
// the manager checks every certificate a CA returns (checkIssued). The
// load's own checks verify the CA's chain for any usage; a CA whose every
// certificate the manager, and peers, would refuse (an intermediate
// allowing server authentication only, a chain longer than peers take, an
// RSA key rustls refuses) is refused here, naming why, rather than loaded
// to fail every pod's certificate at run time.
func (ca *CA) selfCheck() error {
	id := ID{TrustDomain: ca.trustDomain, Namespace: "redirector-ca-check", ServiceAccount: "check"}
	now := time.Now()
	cert, err := ca.signAt(id, now, time.Hour)
	if err == nil {
		_, err = checkIssued(id, &cert, ca.roots, now)
	}
	if err != nil {
		return fmt.Errorf("%s cannot issue a certificate this agent and its peers accept: %w", ca.dir, err)
	}
	return nil
}

func loadIstioCA(dir, trustDomain string) (*CA, error) {
	certPath := filepath.Join(dir, IstioCACertFile)
	certs, err := readCerts(certPath)
	if err != nil {
		return nil, err
	}
	cert := certs[0]
	if err := checkSigningCert(cert, certPath); err != nil {
		return nil, err
	}
	key, err := loadKey(filepath.Join(dir, IstioCAKeyFile), cert, certPath)
	if err != nil {
		return nil, err
	}
	rootPath := filepath.Join(dir, IstioRootCertFile)
	rootCerts, err := readCerts(rootPath)
	if err != nil {
		return nil, err
	}
	roots := x509.NewCertPool()
	for i, r := range rootCerts {
		if !r.IsCA || !r.BasicConstraintsValid {
			return nil, fmt.Errorf("%s: certificate %d (%s) is not a CA certificate", rootPath, i+1, r.Subject)
		}
		roots.AddCert(r)
	}
	chainPath := filepath.Join(dir, IstioCertChainFile)
	chain, err := readCerts(chainPath)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		chain = []*x509.Certificate{cert}
	case err != nil:
		return nil, err
	case !chain[0].Equal(cert):
		return nil, fmt.Errorf("%s: first certificate (%s) is not %s (%s)", chainPath, chain[0].Subject, certPath, cert.Subject)
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return nil, fmt.Errorf("%s does not chain to %s through %s: %w", certPath, rootPath, chainPath, err)
	}
	td, err := pickTrustDomain(trustDomain, cert, rootCerts)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", certPath, err)
	}
	// Peers hold the roots: the chain after the leaf stops below them.
	var present [][]byte
	for _, c := range chain {
		if !isIn(c, rootCerts) {
			present = append(present, c.Raw)
		}
	}
	ca := &CA{cert: cert, key: key, chain: present, trustDomain: td, roots: roots, rootCerts: rootCerts, dir: dir}
	if err := ca.noteKeyMode(filepath.Join(dir, IstioCAKeyFile)); err != nil {
		return nil, err
	}
	if err := ca.selfCheck(); err != nil {
		return nil, err
	}
	return ca, nil
}

func isIn(c *x509.Certificate, set []*x509.Certificate) bool {
	for _, s := range set {
		if c.Equal(s) {
			return true
		}
	}
	return false
}

// checkSigningCert refuses a certificate that cannot sign workload
// certificates now.
func checkSigningCert(cert *x509.Certificate, path string) error {
	if !cert.IsCA || !cert.BasicConstraintsValid {
		return fmt.Errorf("%s is not a CA certificate (basic constraints CA:TRUE missing)", path)
	}
	if cert.KeyUsage != 0 && cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		return fmt.Errorf("%s may not sign certificates (key usage lacks certSign)", path)
	}
	if now := time.Now(); now.After(cert.NotAfter) {
		return fmt.Errorf("%s expired at %s", path, cert.NotAfter.UTC().Format(time.RFC3339))
	}
	return nil
}

// pickTrustDomain checks want against the certificates, or deduces it.
func pickTrustDomain(want string, signing *x509.Certificate, roots []*x509.Certificate) (string, error) {
	if want != "" {
		if err := ValidateTrustDomain(want); err != nil {
			return "", err
		}
		for _, c := range append([]*x509.Certificate{signing}, roots...) {
			for _, u := range c.URIs {
				if u.Scheme == "spiffe" && u.Host != want {
					return "", fmt.Errorf("certificate %s names trust domain %q, not %q", c.Subject, u.Host, want)
				}
			}
		}
		return want, nil
	}
	var firstErr error
	for _, c := range append([]*x509.Certificate{signing}, roots...) {
		td, err := caTrustDomain(c)
		if err == nil {
			return td, nil
		}
		if firstErr == nil {
			firstErr = err
		}
	}
	return "", firstErr
}

// loadKey reads a PEM private key (PKCS#8, PKCS#1 RSA or SEC 1 EC) that must
// belong to cert.
func loadKey(keyPath string, cert *x509.Certificate, certPath string) (crypto.Signer, error) {
	block, err := readPEMBlock(keyPath)
	if err != nil {
		return nil, err
	}
	key, err := parseKey(block)
	if err != nil {
		return nil, fmt.Errorf("parse key %s: %w", keyPath, err)
	}
	pub, ok := key.Public().(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !pub.Equal(cert.PublicKey) {
		return nil, fmt.Errorf("key %s does not match certificate %s", keyPath, certPath)
	}
	return key, nil
}

// maxPEMFileBytes bounds a trust bundle or CA file read: a fifo, a device
// or an outsized file at the path is an error, not a read that blocks or
// fills the memory (the bundle is re-read every 10 s). Istio's root
// ConfigMap, where the bundle comes from, holds at most 1 MiB.
const maxPEMFileBytes = 4 << 20

// readCerts reads every CERTIFICATE block of a PEM file; there must be one.
func readCerts(path string) ([]*x509.Certificate, error) {
	data, err := smallfile.Read(path, maxPEMFileBytes)
	if err != nil {
		return nil, err
	}
	certs, err := ParseCertificates(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return certs, nil
}

// ParseCertificates parses every PEM CERTIFICATE block in data, refusing
// other block types and data with none.
func ParseCertificates(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for i := 1; ; i++ {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			return nil, fmt.Errorf("PEM block %d is %q, want \"CERTIFICATE\"", i, block.Type)
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("certificate %d: %w", i, err)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, errors.New("no PEM certificate found")
	}
	return out, nil
}

func caTrustDomain(cert *x509.Certificate) (string, error) {
	for _, u := range cert.URIs {
		if u.Scheme == "spiffe" {
			if err := ValidateTrustDomain(u.Host); err != nil {
				return "", err
			}
			return u.Host, nil
		}
	}
	if len(cert.Subject.Organization) > 0 {
		td := cert.Subject.Organization[0]
		if err := ValidateTrustDomain(td); err != nil {
			return "", fmt.Errorf("no spiffe:// URI SAN and organization is not a trust domain: %w", err)
		}
		return td, nil
	}
	return "", errors.New("no spiffe:// URI SAN or organization naming the trust domain")
}

func readPEMBlock(path string) (*pem.Block, error) {
	data, err := smallfile.Read(path, maxPEMFileBytes)
	if err != nil {
		return nil, err
	}
	block, _ := pem.Decode(data)
	if block == nil {
		return nil, fmt.Errorf("%s: no PEM block found", path)
	}
	return block, nil
}

func readPEM(path, wantType string) ([]byte, error) {
	block, err := readPEMBlock(path)
	if err != nil {
		return nil, err
	}
	if block.Type != wantType {
		return nil, fmt.Errorf("%s: PEM block is %q, want %q", path, block.Type, wantType)
	}
	return block.Bytes, nil
}

func parseKey(block *pem.Block) (crypto.Signer, error) {
	var k any
	var err error
	switch block.Type {
	case "PRIVATE KEY":
		k, err = x509.ParsePKCS8PrivateKey(block.Bytes)
	case "EC PRIVATE KEY":
		k, err = x509.ParseECPrivateKey(block.Bytes)
	case "RSA PRIVATE KEY":
		k, err = x509.ParsePKCS1PrivateKey(block.Bytes)
	default:
		return nil, fmt.Errorf("PEM block is %q, want \"PRIVATE KEY\", \"EC PRIVATE KEY\" or \"RSA PRIVATE KEY\"", block.Type)
	}
	if err != nil {
		return nil, err
	}
	switch k := k.(type) {
	case *ecdsa.PrivateKey:
		if err := checkKey(k.Public()); err != nil {
			return nil, err
		}
		return k, nil
	case *rsa.PrivateKey:
		if err := checkKey(k.Public()); err != nil {
			return nil, err
		}
		return k, nil
	default:
		return nil, fmt.Errorf("key is %T, want ECDSA or RSA", k)
	}
}

// TrustDomain is the trust domain every certificate from this CA is in.
func (ca *CA) TrustDomain() string { return ca.trustDomain }

// Roots is the pool peers' certificates must chain to. Callers must not
// modify it.
func (ca *CA) Roots() *x509.CertPool { return ca.roots }

// Certificate is the signing certificate (the root in InitCA's layout),
// for display.
func (ca *CA) Certificate() *x509.Certificate { return ca.cert }

// RootCertificates are the mesh roots, for distributing the trust bundle.
func (ca *CA) RootCertificates() []*x509.Certificate { return ca.rootCerts }

// Name implements Signer: "file:" and the CA's directory.
func (ca *CA) Name() string { return "file:" + ca.dir }

// Sign implements Signer: it mints a certificate for id valid for ttl from
// now. See signAt.
func (ca *CA) Sign(ctx context.Context, id ID, ttl time.Duration) (*tls.Certificate, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	cert, err := ca.signAt(id, time.Now(), ttl)
	if err != nil {
		return nil, &CAError{Reason: ReasonLocal, Err: err}
	}
	return &cert, nil
}

// signAt mints an ECDSA P-256 X.509-SVID for id: its only SAN is id's SPIFFE
// URI, it serves as both client and server certificate (a tunnel is both),
// NotBefore is backdated a little for clock skew, and NotAfter never passes
// the signing certificate's. The chain is the leaf and, for an intermediate,
// the certificates up to (not including) the roots peers hold.
func (ca *CA) signAt(id ID, now time.Time, ttl time.Duration) (tls.Certificate, error) {
	if err := id.Validate(); err != nil {
		return tls.Certificate{}, fmt.Errorf("sign: %w", err)
	}
	if id.TrustDomain != ca.trustDomain {
		return tls.Certificate{}, fmt.Errorf("sign %s: trust domain %q is not the ca's %q", id, id.TrustDomain, ca.trustDomain)
	}
	if ttl <= 0 {
		return tls.Certificate{}, fmt.Errorf("sign %s: ttl %s is not positive", id, ttl)
	}
	notAfter := now.Add(ttl)
	if notAfter.After(ca.cert.NotAfter) {
		notAfter = ca.cert.NotAfter
	}
	if !notAfter.After(now) {
		return tls.Certificate{}, fmt.Errorf("sign %s: ca certificate expired at %s", id, ca.cert.NotAfter.UTC().Format(time.RFC3339))
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("sign %s: generate key: %w", id, err)
	}
	serial, err := randomSerial()
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("sign %s: %w", id, err)
	}
	uri := &url.URL{Scheme: "spiffe", Host: id.TrustDomain, Path: "/ns/" + id.Namespace + "/sa/" + id.ServiceAccount}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		// An empty subject makes the SAN extension critical, as the
		// X.509-SVID specification recommends: the identity is the URI.
		NotBefore:             now.Add(-backdate),
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		URIs:                  []*url.URL{uri},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("sign %s: %w", id, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("sign %s: parse minted certificate: %w", id, err)
	}
	chain := append([][]byte{der}, ca.chain...)
	return tls.Certificate{Certificate: chain, PrivateKey: key, Leaf: leaf}, nil
}

// randomSerial returns a positive random 128-bit serial number.
func randomSerial() (*big.Int, error) {
	limit := new(big.Int).Lsh(big.NewInt(1), 128)
	for {
		n, err := rand.Int(rand.Reader, limit)
		if err != nil {
			return nil, fmt.Errorf("serial number: %w", err)
		}
		if n.Sign() > 0 {
			return n, nil
		}
	}
}
