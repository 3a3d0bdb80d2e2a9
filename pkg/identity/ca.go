package identity

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
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

// CA is a root key and self-signed certificate that mints workload
// certificates directly (no intermediate). Every node agent reads the same
// files, so a certificate minted on one node verifies on every other.
type CA struct {
	cert        *x509.Certificate
	key         *ecdsa.PrivateKey
	trustDomain string
	roots       *x509.CertPool
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

// LoadCA reads the CA that InitCA wrote in dir. The trust domain comes from
// the root's spiffe:// URI SAN or, for roots made by other tools (Istio's
// self-signed root has none), from its first Organization. Every error names
// the file at fault.
func LoadCA(dir string) (*CA, error) {
	keyPath := filepath.Join(dir, RootKeyFile)
	certPath := filepath.Join(dir, RootCertFile)

	certDER, err := readPEM(certPath, "CERTIFICATE")
	if err != nil {
		return nil, fmt.Errorf("load ca: %w", err)
	}
	cert, err := x509.ParseCertificate(certDER)
	if err != nil {
		return nil, fmt.Errorf("load ca: parse certificate %s: %w", certPath, err)
	}
	if !cert.IsCA || !cert.BasicConstraintsValid {
		return nil, fmt.Errorf("load ca: %s is not a CA certificate (basic constraints CA:TRUE missing)", certPath)
	}
	if cert.KeyUsage != 0 && cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, fmt.Errorf("load ca: %s may not sign certificates (key usage lacks certSign)", certPath)
	}
	if now := time.Now(); now.After(cert.NotAfter) {
		return nil, fmt.Errorf("load ca: %s expired at %s", certPath, cert.NotAfter.UTC().Format(time.RFC3339))
	}
	td, err := caTrustDomain(cert)
	if err != nil {
		return nil, fmt.Errorf("load ca: %s: %w", certPath, err)
	}

	keyBlock, err := readPEMBlock(keyPath)
	if err != nil {
		return nil, fmt.Errorf("load ca: %w", err)
	}
	key, err := parseECKey(keyBlock)
	if err != nil {
		return nil, fmt.Errorf("load ca: parse key %s: %w", keyPath, err)
	}
	pub, ok := cert.PublicKey.(*ecdsa.PublicKey)
	if !ok || !pub.Equal(&key.PublicKey) {
		return nil, fmt.Errorf("load ca: key %s does not match certificate %s", keyPath, certPath)
	}

	roots := x509.NewCertPool()
	roots.AddCert(cert)
	return &CA{cert: cert, key: key, trustDomain: td, roots: roots}, nil
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
	data, err := os.ReadFile(path)
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

func parseECKey(block *pem.Block) (*ecdsa.PrivateKey, error) {
	switch block.Type {
	case "PRIVATE KEY":
		k, err := x509.ParsePKCS8PrivateKey(block.Bytes)
		if err != nil {
			return nil, err
		}
		ec, ok := k.(*ecdsa.PrivateKey)
		if !ok {
			return nil, fmt.Errorf("key is %T, want ECDSA", k)
		}
		return ec, nil
	case "EC PRIVATE KEY":
		return x509.ParseECPrivateKey(block.Bytes)
	default:
		return nil, fmt.Errorf("PEM block is %q, want \"PRIVATE KEY\" or \"EC PRIVATE KEY\"", block.Type)
	}
}

// TrustDomain is the trust domain every certificate from this CA is in.
func (ca *CA) TrustDomain() string { return ca.trustDomain }

// Roots is the pool peers' certificates must chain to. Callers must not
// modify it.
func (ca *CA) Roots() *x509.CertPool { return ca.roots }

// Certificate is the root certificate, for display and for distributing the
// trust bundle.
func (ca *CA) Certificate() *x509.Certificate { return ca.cert }

// Sign mints a certificate for id valid for ttl from now. See signAt.
func (ca *CA) Sign(id ID, ttl time.Duration) (tls.Certificate, error) {
	return ca.signAt(id, time.Now(), ttl)
}

// signAt mints an ECDSA P-256 X.509-SVID for id: its only SAN is id's SPIFFE
// URI, it serves as both client and server certificate (a tunnel is both),
// NotBefore is backdated a little for clock skew, and NotAfter never passes
// the root's. The chain is the leaf alone: peers hold the root already.
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
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
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
