package faults

import (
	"os"
	"sync"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Servers the package's tests share besides testenv's: a PostgreSQL
// cluster that serves TLS and requires passwords (security tests), started
// on first use and stopped after the last test.
var secure struct {
	once  sync.Once
	pg    *testenv.Postgres
	certs *testenv.Certs
	dir   string
	err   error
}

func closeShared() {
	if secure.pg != nil {
		secure.pg.Close()
	}
	if secure.dir != "" {
		// The certificates and keys the secure cluster used.
		_ = os.RemoveAll(secure.dir)
	}
}
