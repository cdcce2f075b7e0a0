-- Least privilege for outbox-relay, part 2: what only the owner of the
-- outbox table may do. Run once, as that owner, in the application's
-- database, after sql/outbox.sql (the table) and part 1 (the role). The
-- owner needs no REPLICATION; `outbox-relay setup` then runs as
-- outbox_relay and creates the streams and the slot.

-- Connect to the database and read the outbox table: pgoutput reads the
-- published rows with the privileges of the streaming role, and the
-- backfill reads the rows already waiting.
DO $$ BEGIN
  EXECUTE format('GRANT CONNECT ON DATABASE %I TO outbox_relay', current_database());
END $$;
GRANT USAGE ON SCHEMA public TO outbox_relay;
GRANT SELECT ON TABLE public.outbox TO outbox_relay;

-- The publication (CREATE PUBLICATION ... FOR TABLE needs the table's
-- owner and CREATE on the database), as sql/publication.sql creates it.
CREATE PUBLICATION outbox_relay FOR TABLE public.outbox
  WITH (publish = 'insert', publish_via_partition_root = true);
-- The message publication (no tables): if outbox_relay is ever dropped and
-- created again, the relay reads the logical messages of the WAL in
-- between through it.
CREATE PUBLICATION outbox_relay_messages;

-- The record of the backfill (written before the slot is created, marked
-- finished after its last row is acknowledged): `run` refuses a slot whose
-- backfill never finished.
CREATE TABLE IF NOT EXISTS public.outbox_relay_backfill (
    slot_name        name PRIMARY KEY,
    started_at       timestamptz NOT NULL,
    consistent_point pg_lsn,
    finished_at      timestamptz
);
GRANT SELECT ON public.outbox_relay_backfill TO PUBLIC;
GRANT SELECT, INSERT, UPDATE, DELETE ON public.outbox_relay_backfill TO outbox_relay;

-- The record of an open publication gap (rows the publication withheld,
-- written when the relay finds the gap, deleted once it published them):
-- the relay that streams the slot next fills a gap another left open.
CREATE TABLE IF NOT EXISTS public.outbox_relay_gap (
    slot_name   name PRIMARY KEY,
    since_lsn   pg_lsn NOT NULL,
    undecodable boolean NOT NULL DEFAULT false,
    noticed_at  timestamptz NOT NULL
);
GRANT SELECT ON public.outbox_relay_gap TO PUBLIC;
GRANT SELECT, INSERT, UPDATE, DELETE ON public.outbox_relay_gap TO outbox_relay;

-- A table added later goes through the owner the same way:
--   ALTER PUBLICATION outbox_relay ADD TABLE billing.invoice_events;
--   GRANT USAGE ON SCHEMA billing TO outbox_relay;
--   GRANT SELECT ON billing.invoice_events TO outbox_relay;
