// Command outbox-demo shows outbox-relay end to end on one machine, with
// nothing to install but PostgreSQL's server binaries (`make demo` installs
// Debian's postgresql when initdb is missing).
//
// It starts a private PostgreSQL cluster (initdb into a temporary directory,
// wal_level=logical) and an embedded NATS JetStream server, applies
// sql/outbox.sql and sql/example_registration.sql, runs the relay in-process
// with its default subjects (outbox.{aggregate_type}.{aggregate_id}, stream
// OUTBOX, dead letters in OUTBOX_DLQ), confirms a few registrations with the
// seed lesson's data-modifying CTE, and prints every event as it arrives in
// the stream. The reward service then consumes them, first as one consumer,
// then as a consumer group of two members over the stream's 4 partitions,
// one of which crashes while the other takes its partitions over. It exits 0 when every expected event arrived, 1 when one is
// missing or a step failed, and 130 after SIGINT; every server it started is
// stopped and its files removed in each case.
//
// Usage:
//
//	go run ./cmd/outbox-demo [-registrations 3] [-wait 20s] [-sql DIR] [-v]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"
)

func main() {
	var opts options
	flag.IntVar(&opts.registrations, "registrations", 3, "number of registrations to confirm (1 to 100)")
	flag.DurationVar(&opts.wait, "wait", 20*time.Second, "how long to wait for the expected events to arrive in the stream")
	flag.StringVar(&opts.sqlDir, "sql", "", "directory holding outbox.sql and example_registration.sql (default: sql/ of the module containing the working directory)")
	flag.BoolVar(&opts.verbose, "v", false, "log the relay at info level instead of warn")
	flag.Parse()
	if flag.NArg() > 0 || opts.registrations < 1 || opts.registrations > 100 || opts.wait <= 0 {
		flag.Usage()
		os.Exit(2)
	}

	// Catch the signals that end the demo from the start, so that the
	// cleanup runs whenever one arrives: PostgreSQL runs in its own session
	// (pg_ctl calls setsid) and would outlive the demo otherwise. SIGHUP is
	// a closed terminal.
	sigCtx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()
	// A closed stdout (`make demo | head`) would kill the process with
	// SIGPIPE on the next write, skipping the cleanup: ignore the signal,
	// and let the printer end the demo when a write fails instead.
	signal.Ignore(syscall.SIGPIPE)
	ctx, cancel := context.WithCancel(sigCtx)
	defer cancel()

	out := newPrinter(os.Stdout, cancel)
	err := newDemo(out, opts).run(ctx)
	switch {
	case err == nil:
		out.step("demo finished: every expected event arrived and was applied once")
	case ctx.Err() != nil:
		out.step("interrupted: servers stopped and temporary files removed")
		stop()
		cancel()
		os.Exit(130)
	default:
		fmt.Fprintln(os.Stderr, "outbox-demo:", err)
		if errors.Is(err, errMissingEvents) {
			fmt.Fprintln(os.Stderr, "outbox-demo: the relay did not deliver every event; run with -v to see its log")
		}
		stop()
		cancel()
		os.Exit(1)
	}
}
