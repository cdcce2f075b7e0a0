// Package testenv starts the real services that outbox-relay's integration
// tests run against: a private PostgreSQL cluster (initdb into a temporary
// directory, wal_level=logical, unix socket plus a free loopback port) and an
// embedded NATS server with JetStream.
//
// A package starts them at most once, lazily, through [Main] in its TestMain;
// each test then asks for its own database ([Env.NewDatabase]) and unique
// slot, publication and stream names ([UniqueName]) so tests can run in
// parallel. Fault tests that stop or restart a server use a private instance
// ([StartPostgres], [StartNATS]) so they never disturb other tests.
//
// The environment variables OUTBOX_TEST_POSTGRES_URL and OUTBOX_TEST_NATS_URL
// point the same tests at external servers (for example the services of
// docker-compose.yml); the PostgreSQL role must then be allowed to create
// databases and replication slots.
//
// OUTBOX_TEST_PG_VERSION selects the major version of private clusters
// (default: the newest on the host). A version the host lacks runs from a
// root filesystem (OUTBOX_TEST_PG_ROOT, default DefaultPGRoot) that
// scripts/pg17-root.sh prepares and mounts; the harness runs initdb,
// pg_ctl and pg_basebackup there with chroot. The version in use is written
// to the test log when the shared servers start.
//
// [Postgres.StartStandby] adds a physical standby to a private primary
// (pg_basebackup, a physical slot, hot_standby_feedback, and on 17 slot
// synchronisation), which the failover tests promote.
//
// PostgreSQL refuses to run as root. When the tests run as root (as in CI),
// initdb and postgres are run as the "postgres" OS user through runuser, and
// the data directory is created with that owner.
package testenv
