// Package failover holds the tests of a PostgreSQL primary failover and of
// logical decoding on a standby, against a private primary and a physical
// standby (testenv.StartStandby) of the version OUTBOX_TEST_PG_VERSION
// selects:
//
//   - PostgreSQL 17: the relay streams from a failover slot that the
//     standby synchronises; the primary is killed mid-load and the standby
//     promoted; the relay reaches it through a multi-host URL
//     (target_session_attrs=read-write) and resumes from the synchronised
//     slot with nothing missing, no duplicate and no phantom event (the
//     stream's ids equal the new primary's outbox rows). Misconfigurations
//     are reported as "a failover now would lose the slot".
//   - PostgreSQL 15 (and 17 without a failover slot): the promoted server
//     has no slot; the relay stops with the recovery in its error, and the
//     test follows that recovery (setup, reconcile --repair) to 0 missing.
//   - PostgreSQL 16+: the relay decodes from a hot standby and survives the
//     standby's restart.
//
// The package has no code of its own: everything is in its tests.
//
// See https://www.postgresql.org/docs/17/logicaldecoding-explanation.html#LOGICALDECODING-REPLICATION-SLOTS-SYNCHRONIZATION.
package failover
