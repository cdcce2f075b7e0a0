-- Schema of the idempotent consumer library (package consumer) and of the
-- dead-letter tooling (package dlq, `outbox-relay dlq ...`). Run it in the
-- consumer's own database, the one its handlers write their effects to:
-- de-duplication only works when the dedup row and the effect commit in the
-- same transaction. The file is safe to run again.

-- One row per event a consumer has consumed (applied or rejected). The
-- primary key (consumer, event_id) is what makes a redelivery harmless: the
-- library inserts the row with ON CONFLICT DO NOTHING in the transaction of
-- the handler's effect, so the row and the effect commit together or not at
-- all.
--
-- The seed's apply_reward_event (below) inserts only (consumer, event_id,
-- consumed_at); every other column is therefore nullable or defaulted. A row
-- without content_hash (written by that function) is treated as a plain
-- duplicate, because there is nothing to compare a redelivery against.
--
-- event_id is text, not uuid: configured outbox tables may use other id
-- types (bigint, ULID). apply_reward_event still works: PostgreSQL casts its
-- uuid argument to text on insert, in the canonical lower-case form the relay
-- also publishes.
CREATE TABLE IF NOT EXISTS consumed_message (
    consumer          text        NOT NULL,
    event_id          text        NOT NULL,
    consumed_at       timestamptz NOT NULL DEFAULT CURRENT_TIMESTAMP,
    -- SHA-256 over the event's identity and content (type, aggregate type,
    -- aggregate id, aggregate version, payload bytes): the same id arriving
    -- with another hash is a conflict, never a duplicate.
    content_hash      bytea,
    event_type        text,
    aggregate_type    text,
    aggregate_id      text,
    aggregate_version bigint,
    -- applied: the handler's effect committed with this row; rejected: the
    -- handler refused the event for a business reason (consumer.Reject) and
    -- only this row committed; discarded: an operator discarded its dead
    -- letter (`outbox-relay dlq discard`), so a redelivery is a duplicate.
    outcome           text        NOT NULL DEFAULT 'applied'
        CHECK (outcome IN ('applied', 'rejected', 'discarded')),
    reason            text,
    PRIMARY KEY (consumer, event_id)
);

-- Upgrade: earlier versions did not allow the 'discarded' outcome.
-- consumer.Run applies this step too (consumer.Migrate). NOT VALID: the
-- existing rows passed the narrower check, and a large table is not scanned.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = 'consumed_message'::regclass
                   AND conname = 'consumed_message_outcome_check'
                   AND pg_get_constraintdef(oid) LIKE '%discarded%') THEN
        ALTER TABLE consumed_message DROP CONSTRAINT IF EXISTS consumed_message_outcome_check;
        ALTER TABLE consumed_message ADD CONSTRAINT consumed_message_outcome_check
            CHECK (outcome IN ('applied', 'rejected', 'discarded')) NOT VALID;
    END IF;
END
$$;

-- The retention pruner deletes by age, per consumer.
CREATE INDEX IF NOT EXISTS consumed_message_consumer_consumed_at_idx
    ON consumed_message (consumer, consumed_at);

-- The last applied version of each aggregate, per consumer. Used only by
-- consumers that declare they see every event of an aggregate
-- (consumer.Config.VersionCheck): the row is read FOR UPDATE and moved in the
-- transaction that applies the next version, so a version is applied once
-- and in order, whatever order the broker delivers in.
CREATE TABLE IF NOT EXISTS consumer_aggregate_position (
    consumer       text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    version        bigint      NOT NULL,
    -- Identity of the event that moved the aggregate to version: the same
    -- version arriving with another identity is a conflict.
    event_id       text        NOT NULL,
    content_hash   bytea       NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT CURRENT_TIMESTAMP,
    PRIMARY KEY (consumer, aggregate_type, aggregate_id)
);

-- The consumers' dead-letter queue. It lives in the consumer's database (not
-- in a stream) so that a replay can apply the event and close the record in
-- one transaction, and so that `outbox-relay dlq replay` reaches exactly one
-- consumer: the one named by the record. A record keeps everything needed to
-- understand and replay the message: the original payload bytes and headers,
-- the event's identity, where it came from in the stream, and the failure.
CREATE TABLE IF NOT EXISTS consumer_dead_letter (
    id                  bigserial   PRIMARY KEY,
    consumer            text        NOT NULL,
    -- Who must act on this record (consumer.Config.Owner).
    owner               text        NOT NULL DEFAULT '',
    -- Empty when the message broke the header contract and has no event id.
    event_id            text        NOT NULL DEFAULT '',
    event_type          text,
    aggregate_type      text,
    aggregate_id        text,
    aggregate_version   bigint,
    subject             text        NOT NULL,
    stream              text        NOT NULL,
    stream_seq          bigint      NOT NULL,
    -- JetStream's delivery count of the message when it was dead-lettered.
    deliveries          bigint      NOT NULL DEFAULT 0,
    -- The message headers as a JSON object of string arrays, and the payload
    -- bytes exactly as received.
    headers             jsonb       NOT NULL,
    payload             bytea       NOT NULL,
    failure_class       text        NOT NULL
        CHECK (failure_class IN ('transient', 'permanent', 'unknown', 'conflict', 'gap')),
    reason              text        NOT NULL,
    -- Failed handling attempts (for a gap: how often it was deferred).
    attempts            integer     NOT NULL,
    first_failed_at     timestamptz NOT NULL,
    last_failed_at      timestamptz NOT NULL,
    dead_lettered_at    timestamptz NOT NULL DEFAULT CURRENT_TIMESTAMP,
    -- open: waiting for an operator; replaying: `dlq replay` asked the
    -- consumer to apply it again; replayed: the consumer consumed it during a
    -- replay (replay_outcome says how); discarded: `dlq discard` closed it.
    -- A replay that fails again puts the record back to open with the new
    -- reason.
    status              text        NOT NULL DEFAULT 'open'
        CHECK (status IN ('open', 'replaying', 'replayed', 'discarded')),
    replay_token        uuid,
    replay_requested_at timestamptz,
    replay_requested_by text,
    replay_count        integer     NOT NULL DEFAULT 0,
    replay_outcome      text
        CHECK (replay_outcome IN ('applied', 'duplicate', 'rejected')),
    resolved_at         timestamptz,
    resolved_by         text,
    resolution_reason   text
);

-- A message redelivered after its record was written (a crash between the
-- insert and the broker's termination) updates the open record instead of
-- adding a second one. A record belongs to one message: the stream position
-- alone is not its identity, because a stream that is deleted and recreated
-- numbers its messages from 1 again, so the event id and the payload's hash
-- are part of the key.
CREATE UNIQUE INDEX IF NOT EXISTS consumer_dead_letter_event_key
    ON consumer_dead_letter (consumer, stream, stream_seq, event_id, sha256(payload))
    WHERE status IN ('open', 'replaying');
-- Upgrade: the key of earlier versions (consumer, stream, stream_seq) merged
-- a new message into the open record of an old one at the same sequence.
-- consumer.Run applies this step too (consumer.Migrate).
DROP INDEX IF EXISTS consumer_dead_letter_message_key;

-- Replays run in aggregate order; gap checks look for a dead-lettered
-- earlier version of the same aggregate.
CREATE INDEX IF NOT EXISTS consumer_dead_letter_aggregate_idx
    ON consumer_dead_letter (consumer, status, aggregate_type, aggregate_id, aggregate_version);

-- The audit trail of operator actions on consumer dead letters: one row per
-- record and action, written in the same transaction as the action.
CREATE TABLE IF NOT EXISTS consumer_dlq_audit (
    id             bigserial   PRIMARY KEY,
    at             timestamptz NOT NULL DEFAULT CURRENT_TIMESTAMP,
    actor          text        NOT NULL CHECK (actor <> ''),
    action         text        NOT NULL CHECK (action IN ('replay', 'discard')),
    consumer       text        NOT NULL,
    dead_letter_id bigint      NOT NULL,
    event_id       text        NOT NULL DEFAULT '',
    reason         text        NOT NULL DEFAULT '',
    -- The record's failure class and reason at the time of the action.
    detail         jsonb       NOT NULL DEFAULT '{}'
);

CREATE INDEX IF NOT EXISTS consumer_dlq_audit_at_idx ON consumer_dlq_audit (at);

-- The seed lesson's idempotent reward function, unchanged. It expects
-- reward_account (sql/reward.sql) and dedups on consumed_message in the
-- caller's transaction: true when applied, false when already consumed; a
-- non-positive delta, a missing account or an integer overflow raises, which
-- rolls back the dedup row with everything else. DROP first only so that this
-- file can run again without altering the seed's text.
DROP FUNCTION IF EXISTS apply_reward_event(text, uuid, uuid, integer);
CREATE FUNCTION apply_reward_event(
    p_consumer text, p_event_id uuid, p_player_id uuid, p_delta integer
) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF p_delta IS NULL OR p_delta <= 0 THEN
        RAISE EXCEPTION 'reward delta must be positive';
    END IF;

    INSERT INTO consumed_message (consumer, event_id, consumed_at)
    VALUES (p_consumer, p_event_id, CURRENT_TIMESTAMP)
    ON CONFLICT (consumer, event_id) DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;

    UPDATE reward_account
    SET points = points + p_delta
    WHERE player_id = p_player_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'reward account not found: %', p_player_id;
    END IF;
    RETURN true;
END;
$$;
