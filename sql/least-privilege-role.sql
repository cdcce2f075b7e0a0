-- Least privilege for outbox-relay, part 1: the relay's role. Run once, as
-- a role that may create roles (a superuser, or one with CREATEROLE).

-- The role `outbox-relay setup`, `run` and `status` connect as: it may log
-- in and stream from a replication slot (REPLICATION), nothing more.
CREATE ROLE outbox_relay WITH LOGIN REPLICATION PASSWORD 'change-me';
