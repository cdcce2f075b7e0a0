// Package faults holds outbox-relay's fault-tolerance, high-availability and
// security test suite (issue 6). It has no code of its own besides tests:
// each test runs the real relay (the outbox-relay binary, or the relay
// package in-process where goroutines are counted) against real PostgreSQL
// and real NATS JetStream from internal/testenv, drives a steady load over
// many aggregates while a fault happens, and then checks the guarantees
// docs/faults.md states:
//
//   - every committed outbox row is in the stream (or, when the broker
//     rejected it for good, in the dead-letter stream);
//   - no aggregate's events are out of version order;
//   - no event id is stored twice (the duplicate window covers the outage);
//   - the slot's confirmed_flush_lsn, sampled during the whole run, never
//     covered a transaction whose events were not yet stored.
//
// Faults: SIGKILL of the relay at the windows that matter, NATS restarts
// (short and long), the loss of a stream leader in a three-node cluster,
// PostgreSQL fast and immediate restarts, network cuts, stalls and slowness
// through a TCP proxy, an invalidated slot, permanent broker rejections and
// missing streams, the loss of the active relay of a hot-standby pair, and
// 100 reconnect cycles without leaks. Security: PostgreSQL TLS with
// verify-full, NATS TLS, mutual TLS, user/password, NKey and .creds
// authentication, secrets kept out of every output, and least-privilege
// grants for both servers, exercised verbatim from testdata/.
//
// `go test` runs short variants. OUTBOX_CHAOS=1 (`make chaos`) runs the long
// ones and prints a summary table, one row per fault.
package faults
