"""Views: pandas + plotly over records (figures, tables, summaries, live followers). No training, no Streamlit.

May import: every engine package (they read what the engine recorded); never Streamlit. Nothing in the engine
imports views: the pages and the CLI do.
"""
