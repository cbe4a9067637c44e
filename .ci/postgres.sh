#!/usr/bin/env bash
# PostgreSQL on 127.0.0.1:5432 for tests/test_tune_postgres.py (two tuning drivers on one study).
# Installs Debian's postgresql if missing, starts it, creates user `advisor` and database
# `advisor_test`, installs psycopg2-binary. Prints ONE line on stdout, to eval:
#   export ADVISOR_TEST_POSTGRES_URL=postgresql+psycopg2://advisor:advisor@127.0.0.1:5432/advisor_test
# Everything else goes to stderr. Usage: eval "$(bash .ci/postgres.sh)"
set -euo pipefail
exec 3>&1 1>&2
if ! command -v pg_ctlcluster >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
fi
python3 -c "import psycopg2" 2>/dev/null || python3 -m pip install -q psycopg2-binary
ver=$(ls /usr/lib/postgresql | sort -V | tail -1)
pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "$ver main" || pg_createcluster "$ver" main --port 5432
if ! pg_lsclusters -h | awk -v v="$ver" '$1==v && $2=="main" {print $4}' | grep -qx online; then
  # The server outlives this script: it must not inherit fd 3 (the caller's $(...) pipe would never
  # close and CI would hang) nor the CI log's stdout/stderr.
  pg_ctlcluster "$ver" main start -- -o "-c listen_addresses=127.0.0.1 -c port=5432" -w \
    </dev/null >/tmp/advisor-postgres-start.log 2>&1 3>&- ||
    { cat /tmp/advisor-postgres-start.log; exit 1; }
fi
pg_isready -h 127.0.0.1 -p 5432 -t 30
psql_() { runuser -u postgres -- psql -p 5432 -v ON_ERROR_STOP=1 -qtA "$@"; }
psql_ -c "DO \$\$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'advisor') THEN
          CREATE ROLE advisor LOGIN PASSWORD 'advisor'; END IF; END \$\$;"
[ "$(psql_ -c "SELECT 1 FROM pg_database WHERE datname = 'advisor_test'")" = 1 ] ||
  runuser -u postgres -- createdb -p 5432 -O advisor advisor_test
url=postgresql+psycopg2://advisor:advisor@127.0.0.1:5432/advisor_test
python3 -c "import sqlalchemy as s; s.create_engine('$url').connect().close()"
echo "export ADVISOR_TEST_POSTGRES_URL=$url" >&3
