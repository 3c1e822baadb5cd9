#!/bin/sh
# git as an agent runs it through a terminated host: the proxy from HTTPS_PROXY, the CA from
# GIT_SSL_CAINFO, the placeholder from GITHUB_TOKEN in an extra Authorization header.
#
#   sh git_ls_remote.sh URL
exec git -c "http.extraHeader=Authorization: Bearer $GITHUB_TOKEN" ls-remote "$1"
