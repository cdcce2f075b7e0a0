package testenv

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"time"
)

// Certs are PEM files of a throw-away certificate authority, a server
// certificate it signed for 127.0.0.1, ::1 and localhost, and a client
// certificate it signed (for mutual TLS).
type Certs struct {
	Dir string
	// CAFile is the CA certificate clients verify servers with
	// (sslrootcert, nats.ca_file).
	CAFile string
	// ServerCert and ServerKey are the server's certificate and key. When
	// the tests run as root the key belongs to the "postgres" OS user with
	// mode 0600, as PostgreSQL requires; root can read it anyway.
	ServerCert, ServerKey string
	// ClientCert and ClientKey identify a client (CN "outbox-relay").
	ClientCert, ClientKey string
}

// NewCerts writes a new CA, server and client certificate into dir (made
// world-traversable so a PostgreSQL server running as another OS user can
// read its files).
func NewCerts(dir string) (*Certs, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return nil, err
	}
	c := &Certs{
		Dir:        dir,
		CAFile:     filepath.Join(dir, "ca.crt"),
		ServerCert: filepath.Join(dir, "server.crt"),
		ServerKey:  filepath.Join(dir, "server.key"),
		ClientCert: filepath.Join(dir, "client.crt"),
		ClientKey:  filepath.Join(dir, "client.key"),
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "outbox-relay test CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, err
	}
	if err := writePEM(c.CAFile, "CERTIFICATE", caDER, 0o644); err != nil {
		return nil, err
	}
	leaf := func(cn string, usage x509.ExtKeyUsage, certFile, keyFile string) error {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return err
		}
		tmpl := &x509.Certificate{
			SerialNumber: serial(),
			Subject:      pkix.Name{CommonName: cn},
			NotBefore:    now.Add(-time.Hour),
			NotAfter:     now.Add(24 * time.Hour),
			KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
			ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		}
		if usage == x509.ExtKeyUsageServerAuth {
			tmpl.DNSNames = []string{"localhost"}
			tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			return err
		}
		if err := writePEM(certFile, "CERTIFICATE", der, 0o644); err != nil {
			return err
		}
		kder, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			return err
		}
		return writePEM(keyFile, "PRIVATE KEY", kder, 0o600)
	}
	if err := leaf("127.0.0.1", x509.ExtKeyUsageServerAuth, c.ServerCert, c.ServerKey); err != nil {
		return nil, fmt.Errorf("server certificate: %w", err)
	}
	if err := leaf("outbox-relay", x509.ExtKeyUsageClientAuth, c.ClientCert, c.ClientKey); err != nil {
		return nil, fmt.Errorf("client certificate: %w", err)
	}
	if os.Geteuid() == 0 {
		// PostgreSQL runs as "postgres" and insists its key is private to it.
		if u, err := user.Lookup("postgres"); err == nil {
			uid, _ := strconv.Atoi(u.Uid)
			gid, _ := strconv.Atoi(u.Gid)
			if err := os.Chown(c.ServerKey, uid, gid); err != nil {
				return nil, err
			}
		}
	}
	return c, nil
}

// PostgresTLS returns the settings that make a private cluster serve TLS
// with these certificates (clients may then use sslmode=verify-full with
// sslrootcert=CAFile).
func (c *Certs) PostgresTLS() []PostgresOption {
	q := func(s string) string { return "'" + s + "'" }
	return []PostgresOption{
		WithSetting("ssl", "on"),
		WithSetting("ssl_cert_file", q(c.ServerCert)),
		WithSetting("ssl_key_file", q(c.ServerKey)),
		WithSetting("ssl_ca_file", q(c.CAFile)),
	}
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	return n
}

func writePEM(path, typ string, der []byte, mode os.FileMode) error {
	b := pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
	return os.WriteFile(path, b, mode)
}
