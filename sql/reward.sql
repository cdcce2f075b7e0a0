-- Tables of the seed's reward scenario (cmd/reward-consumer). Run after
-- sql/consumer.sql in the reward consumer's database.

-- One account per player; apply_reward_event adds to points. The seed asks
-- for a unique player_id and non-null integer points: an overflow of points
-- raises (integer out of range) and rolls the whole event back.
CREATE TABLE IF NOT EXISTS reward_account (
    player_id uuid    PRIMARY KEY,
    points    integer NOT NULL DEFAULT 0
);

-- Which player a registration belongs to. RegistrationConfirmed carries only
-- the registration id and version, so the reward service keeps this mapping
-- of its own (filled when a player registers; the demo inserts it). There is
-- deliberately no foreign key to reward_account: a registration whose player
-- has no account yet is the seed's "reward account not found" failure, which
-- the consumer dead-letters until the account is opened and the record is
-- replayed.
CREATE TABLE IF NOT EXISTS reward_registration (
    registration_id uuid PRIMARY KEY,
    player_id       uuid NOT NULL
);
