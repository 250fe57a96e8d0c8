"""The Trinity-RFT backbone (`pip install 'ajet[trinity]'`): ajet samples as Trinity `Experience`s."""
