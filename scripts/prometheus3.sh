#!/usr/bin/env bash
# Fetches the Prometheus 3 LTS line and a current Alertmanager (Debian unstable's prometheus,
# promtool and prometheus-alertmanager packages) and unpacks them into a folder of their own,
# leaving the system's packages (Debian stable's Prometheus 2) as they are. Idempotent.
# Prints the folder of binaries to put first on PATH:
#   PATH="$(scripts/prometheus3.sh):$PATH" promtool --version
# They are Go binaries that link only libc: they run on Debian stable as they are.
set -euo pipefail
DEST=${LOSSBEAT_PROMETHEUS3_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/lossbeat/prometheus-3}
SUITE=${LOSSBEAT_PROMETHEUS3_SUITE:-sid}
BIN="$DEST/bin"

if [ -x "$BIN/prometheus" ] && [ -x "$BIN/promtool" ] && [ -x "$BIN/alertmanager" ] && [ -x "$BIN/amtool" ]; then
  echo "$BIN"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "prometheus3.sh: apt-get needs root to read Debian $SUITE's package index" >&2
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/etc/preferences.d" "$work/lists/partial" "$work/archives/partial" "$work/debs"
cat >"$work/etc/$SUITE.sources" <<SOURCES
Types: deb
URIs: http://deb.debian.org/debian
Suites: $SUITE
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
# A private package index: the system's sources, lists and cache are not touched.
apt_private=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$work/etc"
  -o "Dir::Etc::Preferences=/dev/null" -o "Dir::Etc::PreferencesParts=$work/etc/preferences.d"
  -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work" -o "APT::Sandbox::User=root")
apt-get -qq "${apt_private[@]}" update
(cd "$work/debs" && apt-get -qq "${apt_private[@]}" download prometheus promtool prometheus-alertmanager)

rm -rf "$DEST"
mkdir -p "$BIN"
for deb in "$work"/debs/*.deb; do
  dpkg-deb -x "$deb" "$DEST/root"
done
for name in prometheus promtool amtool; do
  ln -sf "../root/usr/bin/$name" "$BIN/$name"
done
# Debian names the Alertmanager binary prometheus-alertmanager; the tests look for either.
ln -sf ../root/usr/bin/prometheus-alertmanager "$BIN/alertmanager"
ln -sf ../root/usr/bin/prometheus-alertmanager "$BIN/prometheus-alertmanager"

"$BIN/prometheus" --version 2>&1 | head -1 >&2
"$BIN/alertmanager" --version 2>&1 | head -1 >&2
echo "$BIN"
