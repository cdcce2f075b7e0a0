-- The relay's role in docker-compose.yml, created when the postgres container
-- initialises its data directory (after sql/outbox.sql and
-- sql/publication.sql, in the POSTGRES_DB database).
--
-- Least privilege: LOGIN and REPLICATION (to create the slot and stream the
-- WAL); SELECT on the outbox table (README, "A role for the relay"). The
-- publication already exists, so the role does not need to own the table.
-- The password is for local use only: change it (and
-- OUTBOX_RELAY_POSTGRES_URL in docker-compose.yml) anywhere else.
CREATE ROLE outbox_relay WITH LOGIN REPLICATION PASSWORD 'outbox_relay';
GRANT SELECT ON public.outbox TO outbox_relay;
