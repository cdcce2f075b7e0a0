-- Least privilege for outbox-relay. Run once, as the owner of the outbox
-- table (or a superuser), in the application's database.

-- The role `outbox-relay run` and `outbox-relay status` connect as: it may
-- log in and stream from a replication slot, nothing more.
CREATE ROLE outbox_relay WITH LOGIN REPLICATION PASSWORD 'change-me';

-- Connect to the database and read the outbox table: pgoutput reads the
-- published rows with the privileges of the streaming role.
DO $$ BEGIN
  EXECUTE format('GRANT CONNECT ON DATABASE %I TO outbox_relay', current_database());
END $$;
GRANT USAGE ON SCHEMA public TO outbox_relay;
GRANT SELECT ON TABLE public.outbox TO outbox_relay;

-- `outbox-relay setup` (CREATE PUBLICATION ... FOR TABLE needs the table's
-- owner) runs once as the owner, e.g.
--   OUTBOX_RELAY_POSTGRES_URL=postgres://app_owner@db/app outbox-relay setup
-- After that `run` finds the publication and the slot and creates nothing.
