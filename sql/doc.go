// Package sql holds the SQL files of outbox-relay: the outbox table
// (outbox.sql), the publication the relay reads (publication.sql), the
// consumer side's tables, and the seed lesson's example business table with
// its outbox-writing CTE (example_registration.sql). The package's tests run
// these files against a real PostgreSQL.
package sql
