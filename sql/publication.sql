-- The publication outbox-relay reads. publish = 'insert' keeps UPDATEs and
-- DELETEs of outbox rows (cleanup, publish_state changes, the
-- insert-then-delete pattern) out of the WAL stream the relay sees: only the
-- INSERT is an event. `outbox-relay setup` creates the same publication for
-- the tables in its configuration.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'outbox_relay') THEN
        CREATE PUBLICATION outbox_relay FOR TABLE outbox WITH (publish = 'insert', publish_via_partition_root = true);
    END IF;
    -- No tables: if outbox_relay is ever dropped and created again, the
    -- relay reads the logical messages of the WAL in between through it.
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'outbox_relay_messages') THEN
        CREATE PUBLICATION outbox_relay_messages;
    END IF;
END
$$;
