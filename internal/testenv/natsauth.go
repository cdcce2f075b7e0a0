package testenv

import (
	"crypto/tls"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"
)

// WithNATSConfig applies a nats-server configuration text (the format of
// nats-server.conf: an authorization block, accounts, operator, tls...) to
// an embedded server, keeping the harness's listen address, port, store
// directory and JetStream setting. Tests use it to run the exact blocks the
// documentation shows. It fails when the text does not parse.
func WithNATSConfig(conf string) (NATSOption, error) {
	parsed := &server.Options{}
	if err := parsed.ProcessConfigString(conf); err != nil {
		return nil, fmt.Errorf("nats config: %w", err)
	}
	return func(o *server.Options) {
		keep := *o
		*o = *parsed
		o.ServerName, o.Host, o.Port = keep.ServerName, keep.Host, keep.Port
		o.JetStream, o.StoreDir = keep.JetStream, keep.StoreDir
		o.NoLog, o.NoSigs, o.MaxPayload = keep.NoLog, keep.NoSigs, keep.MaxPayload
		o.Cluster, o.Routes = keep.Cluster, keep.Routes
	}, nil
}

// WithNATSTLS makes the embedded server require TLS with c's server
// certificate; with verifyClients it also requires a client certificate
// signed by c's CA (mutual TLS).
func WithNATSTLS(c *Certs, verifyClients bool) (NATSOption, error) {
	tc, err := server.GenTLSConfig(&server.TLSConfigOpts{
		CertFile: c.ServerCert,
		KeyFile:  c.ServerKey,
		CaFile:   c.CAFile,
		Verify:   verifyClients,
		Timeout:  5,
	})
	if err != nil {
		return nil, fmt.Errorf("nats tls: %w", err)
	}
	tc.MinVersion = tls.VersionTLS12
	return func(o *server.Options) {
		o.TLS = true
		o.TLSVerify = verifyClients
		o.TLSConfig = tc
		o.TLSTimeout = 5
	}, nil
}

// NKeyUser is a user key pair for NKey authentication.
type NKeyUser struct {
	Public   string // the U... public key the server trusts
	SeedFile string // file holding the seed (nats.nkey_seed_file)
}

// NewNKeyUser creates a user key pair and writes its seed to dir/name.nk.
func NewNKeyUser(dir, name string) (*NKeyUser, error) {
	kp, err := nkeys.CreateUser()
	if err != nil {
		return nil, err
	}
	pub, err := kp.PublicKey()
	if err != nil {
		return nil, err
	}
	seed, err := kp.Seed()
	if err != nil {
		return nil, err
	}
	f := filepath.Join(dir, name+".nk")
	if err := os.WriteFile(f, seed, 0o600); err != nil {
		return nil, err
	}
	return &NKeyUser{Public: pub, SeedFile: f}, nil
}

// OperatorAuth is decentralised (JWT) authentication: an operator, a
// system account, an application account with JetStream enabled and one
// user of it, whose credentials are in a .creds file.
type OperatorAuth struct {
	// Config is the server configuration (operator, memory resolver with
	// both accounts preloaded, system account) for WithNATSConfig.
	Config string
	// CredsFile is the user's .creds file (nats.credentials_file).
	CredsFile string
	// UserSeed is the seed inside CredsFile: a secret tests look for in
	// output that must not contain it.
	UserSeed string
}

// NewOperatorAuth creates the keys and JWTs and writes dir/user.creds.
func NewOperatorAuth(dir string) (*OperatorAuth, error) {
	okp, err := nkeys.CreateOperator()
	if err != nil {
		return nil, err
	}
	opub, _ := okp.PublicKey()
	oc := jwt.NewOperatorClaims(opub)
	oc.Name = "outbox-test-operator"
	account := func(name string, js bool) (nkeys.KeyPair, string, string, error) {
		akp, err := nkeys.CreateAccount()
		if err != nil {
			return nil, "", "", err
		}
		apub, _ := akp.PublicKey()
		ac := jwt.NewAccountClaims(apub)
		ac.Name = name
		if js {
			ac.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
		}
		tok, err := ac.Encode(okp)
		return akp, apub, tok, err
	}
	_, sysPub, sysJWT, err := account("SYS", false)
	if err != nil {
		return nil, err
	}
	oc.SystemAccount = sysPub
	ojwt, err := oc.Encode(okp)
	if err != nil {
		return nil, err
	}
	appKP, appPub, appJWT, err := account("APP", true)
	if err != nil {
		return nil, err
	}
	ukp, err := nkeys.CreateUser()
	if err != nil {
		return nil, err
	}
	upub, _ := ukp.PublicKey()
	uc := jwt.NewUserClaims(upub)
	uc.Name = "outbox-relay"
	uc.IssuerAccount = ""
	ujwt, err := uc.Encode(appKP)
	if err != nil {
		return nil, err
	}
	useed, _ := ukp.Seed()
	creds, err := jwt.FormatUserConfig(ujwt, useed)
	if err != nil {
		return nil, err
	}
	f := filepath.Join(dir, "user.creds")
	if err := os.WriteFile(f, creds, 0o600); err != nil {
		return nil, err
	}
	var conf strings.Builder
	fmt.Fprintf(&conf, "operator: %q\n", ojwt)
	fmt.Fprintf(&conf, "system_account: %q\n", sysPub)
	fmt.Fprintf(&conf, "resolver: MEMORY\n")
	fmt.Fprintf(&conf, "resolver_preload: {\n  %s: %q\n  %s: %q\n}\n", sysPub, sysJWT, appPub, appJWT)
	return &OperatorAuth{Config: conf.String(), CredsFile: f, UserSeed: string(useed)}, nil
}
