package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/logging"
)

func newLogger(c config.Log) (*zap.Logger, error) { return logging.New(c.Level, c.Format) }

// connectNATS connects with reconnects that never give up: the relay keeps
// its position in PostgreSQL, so waiting for the broker is always right.
// It waits up to 10 s for the first connection, so that a command reports
// an unreachable server rather than retrying silently.
func connectNATS(c config.NATS, log *zap.Logger, name string) (*nats.Conn, error) {
	attempts := &natsAttempts{}
	nc, err := dialNATS(c, log, name, attempts)
	if err != nil {
		return nil, err
	}
	if err := waitNATS(context.Background(), nc, attempts, c.URL, 10*time.Second, nil); err != nil {
		nc.Close()
		return nil, err
	}
	return nc, nil
}

// natsAttempts keeps the latest failed connection attempt's error:
// nats.go reports it to ReconnectErrHandler only and clears LastError
// after each attempt, so a wait for the first connection could not say why
// it still waits.
type natsAttempts struct{ last atomic.Pointer[error] }

func (a *natsAttempts) record(_ *nats.Conn, err error) {
	if err != nil {
		a.last.Store(&err)
	}
}

// err returns the latest attempt's error, nil before any failed.
func (a *natsAttempts) err() error {
	if e := a.last.Load(); e != nil {
		return *e
	}
	return nil
}

// dialNATS returns a connection that connects, and reconnects, in the
// background (RetryOnFailedConnect): it is not connected yet. Failed
// attempts are recorded in attempts.
func dialNATS(c config.NATS, log *zap.Logger, name string, attempts *natsAttempts) (*nats.Conn, error) {
	opts := []nats.Option{
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectJitter(100*time.Millisecond, time.Second),
		nats.Timeout(5 * time.Second),
		// A stalled connection is detected within PingInterval*MaxPingsOut.
		nats.PingInterval(5 * time.Second),
		nats.MaxPingsOutstanding(2),
		nats.RetryOnFailedConnect(true),
		nats.ReconnectErrHandler(attempts.record),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", zap.Error(err))
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log.Info("nats reconnected", zap.String("server", nc.ConnectedUrlRedacted()))
		}),
	}
	switch {
	case c.CredentialsFile != "":
		opts = append(opts, nats.UserCredentials(c.CredentialsFile))
	case c.NKeySeedFile != "":
		o, err := nats.NkeyOptionFromSeed(c.NKeySeedFile)
		if err != nil {
			return nil, fmt.Errorf("nats.nkey_seed_file: %w", err)
		}
		opts = append(opts, o)
	case c.User != "":
		opts = append(opts, nats.UserInfo(c.User, c.Password))
	}
	if c.CAFile != "" || c.CertFile != "" {
		tc := &tls.Config{MinVersion: tls.VersionTLS12}
		if c.CAFile != "" {
			pem, err := os.ReadFile(c.CAFile)
			if err != nil {
				return nil, fmt.Errorf("nats.ca_file: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("nats.ca_file %s holds no PEM certificate", c.CAFile)
			}
			tc.RootCAs = pool
		}
		if c.CertFile != "" {
			cert, err := tls.LoadX509KeyPair(c.CertFile, c.KeyFile)
			if err != nil {
				return nil, fmt.Errorf("nats.cert_file/key_file: %w", err)
			}
			tc.Certificates = []tls.Certificate{cert}
		}
		opts = append(opts, nats.Secure(tc))
	}
	nc, err := nats.Connect(c.URL, opts...)
	if err != nil {
		return nil, fmt.Errorf("connect to nats %s: %w", config.RedactURL(c.URL), err)
	}
	return nc, nil
}
