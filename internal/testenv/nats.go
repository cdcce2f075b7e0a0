package testenv

import (
	"fmt"
	"net"
	"os"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// NATS is an embedded NATS server with JetStream, or an external server named
// by OUTBOX_TEST_NATS_URL.
type NATS struct {
	// URL is the client URL, stable across Restart.
	URL string

	external bool
	opts     *server.Options
	srv      *server.Server
	storeDir string
}

// NATSOption adjusts the options of an embedded server before it starts.
type NATSOption func(*server.Options)

// StartNATS starts an embedded JetStream server on a free loopback port with a
// file store in a new temporary directory. It ignores OUTBOX_TEST_NATS_URL:
// callers that need to stop or restart the server use it.
func StartNATS(opts ...NATSOption) (*NATS, error) {
	dir, err := os.MkdirTemp("", "outbox-relay-nats-")
	if err != nil {
		return nil, err
	}
	// The server picks its port when it binds (a port FreePort found may
	// be taken by the time the server binds it, with every package's
	// servers and connections drawing from the same range); a restart
	// binds the same one again.
	o := &server.Options{
		ServerName: "outbox-relay-test",
		Host:       "127.0.0.1",
		Port:       server.RANDOM_PORT,
		JetStream:  true,
		StoreDir:   dir,
		NoLog:      true,
		NoSigs:     true,
		// Large enough for the tests' 1 MiB payloads; the relay reads the
		// real value from the connection.
		MaxPayload: 1 << 20,
	}
	for _, opt := range opts {
		opt(o)
	}
	n := &NATS{opts: o, storeDir: dir}
	if err := n.Start(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if addr, ok := n.srv.Addr().(*net.TCPAddr); ok {
		n.opts.Port = addr.Port
	}
	n.URL = fmt.Sprintf("nats://127.0.0.1:%d", n.opts.Port)
	return n, nil
}

func externalNATS(url string) *NATS { return &NATS{URL: url, external: true} }

// natsReadyTimeout bounds how long a starting embedded server may take to
// accept connections.
const natsReadyTimeout = time.Minute

// Start starts a stopped embedded server on the same port and store directory,
// so streams and their messages survive a Stop/Start cycle.
func (n *NATS) Start() error {
	if n.external {
		return fmt.Errorf("cannot start an external NATS server")
	}
	if n.srv != nil && n.srv.Running() {
		return nil
	}
	o := *n.opts
	srv, err := server.NewServer(&o)
	if err != nil {
		return fmt.Errorf("nats server: %w", err)
	}
	go srv.Start()
	// A cluster node also waits for its routes and JetStream: on a CI
	// machine running every package at once that took over 20 s.
	if !srv.ReadyForConnections(natsReadyTimeout) {
		srv.Shutdown()
		return fmt.Errorf("nats server on port %d not ready within %s", n.opts.Port, natsReadyTimeout)
	}
	n.srv = srv
	return nil
}

// Stop shuts the embedded server down; clients see their connections drop.
func (n *NATS) Stop() {
	if n.external || n.srv == nil {
		return
	}
	n.srv.Shutdown()
	n.srv.WaitForShutdown()
	n.srv = nil
}

// Server returns the running embedded server, or nil.
func (n *NATS) Server() *server.Server { return n.srv }

// Close stops the embedded server and removes its store.
func (n *NATS) Close() {
	if n.external {
		return
	}
	n.Stop()
	_ = os.RemoveAll(n.storeDir)
}
